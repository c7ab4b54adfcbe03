"""Every tutorial runs end to end in its quick mode and writes its figures (CI keeps them
working; the tutorials assert their own results against plain-torch references)."""

import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted(p for p in (Path(__file__).resolve().parent.parent / "tutorials").glob("*.py") if not p.name.startswith("_"))


def test_there_are_tutorials():
    assert {p.stem for p in TUTORIALS} >= {"per_sample_gradients", "jacobians_hessians", "ensembling", "maml"}


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_quick(tutorial, tmp_path):
    result = subprocess.run(
        [sys.executable, str(tutorial), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{tutorial.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert list(tmp_path.glob("*.png")), f"{tutorial.name} saved no figure"


EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_quick_and_prints_what_it_measures(example):
    """The examples run in quick mode too, pinned to one thread (they say so), and print
    their measurements: `examples/vmap_demo.py` once timed vmap on every core of a busy
    machine and reported it 3x slower than a loop."""
    result = subprocess.run([sys.executable, str(example), "--quick"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{example.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "1 thread" in result.stdout and "median" in result.stdout, result.stdout


# -- the tutorial pages show what the scripts print (scripts/render_tutorials.py) -------------

TINY_TUTORIAL = '''"""A tiny tutorial: what its page shows of its output."""

# %%
import argparse
import multiprocessing

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true")
parser.add_argument("--out")
args = parser.parse_args()


def helper():
    print("from the helper")


def in_a_child():
    print("from a child process")

# %% [markdown]
# Some text.

# %%
def main():
    print("from main, quick" if args.quick else "from main, full")
    helper()

# %%
if __name__ == "__main__":
    main()
    process = multiprocessing.get_context("spawn").Process(target=in_a_child)
    process.start()
    process.join()
    print("the end:", 2 + 2)
'''


def test_a_tutorial_page_shows_what_each_cell_printed(tmp_path):
    """Captured at build time in the quick mode: each print under the cell of the line that
    printed it (a child process's too), in order; a failing tutorial fails the render."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import render_tutorials

    script = tmp_path / "tiny.py"
    script.write_text(TINY_TUTORIAL)
    output = render_tutorials.printed(script)
    assert [text for _, text in output] == ["from main, quick\n", "from the helper\n", "from a child process\n", "the end: 4\n"]
    page = render_tutorials.render(script, output)
    blocks = page.split("```python")
    assert len(blocks) == 4  # the three code cells
    first, second, third = blocks[1:]
    assert "from the helper" in first and "from a child process" in first
    assert "from main, quick" in second and "from the helper" not in second
    assert "the end: 4" in third and "from main" not in third
    assert "*Printed (the `--quick` run" in first
    assert "This build did not run the tutorials" in render_tutorials.render(script, None)

    script.write_text(TINY_TUTORIAL.replace('print("the end:", 2 + 2)', "raise SystemExit(3)"))
    with pytest.raises(RuntimeError, match="tiny.py failed"):
        render_tutorials.printed(script)
