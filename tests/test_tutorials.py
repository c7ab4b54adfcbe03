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
