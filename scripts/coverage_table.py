"""Generate docs/coverage.md: how functx.vmap handles every op in torch's op database.

For every op_db OpInfo with float32 CPU samples it runs the same checks as
tests/vmap/test_op_db.py (`tests/vmap/opdb_support.check_op`: vmap against a per-sample
loop, batch at dim 0, at a trailing dim, one argument unbatched; per-sample fallback
switched off first), records every aten overload that reached a vmap level and how
`VMAP_RULES` handles it (rule / template / decomposition / fallback / missing), and writes
the measured fractions (overall and per family), a per-op table and a per-overload table.

Usage (from the repository root):
    .venv/bin/python scripts/coverage_table.py --jobs 2            # writes docs/coverage.md
    .venv/bin/python scripts/coverage_table.py --ops add cat --stdout
    .venv/bin/python scripts/coverage_table.py --summary            # fractions only, no file
Exit status 1 when fewer than --target (default 0.95) of the ops are correct and vectorized.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_OUTPUT = os.path.join(ROOT, "docs", "coverage.md")
REGENERATE = ".venv/bin/python scripts/coverage_table.py --jobs 2"


def _check(args):
    """Worker: check one op (by id; its in-place variant with `inplace`); a plain dict."""
    identifier, samples, inplace = args
    import torch

    torch.set_num_threads(1)
    from tests.vmap.opdb_support import check_op, family_of, find_op

    result = check_op(find_op(identifier), samples, inplace=inplace)
    return {
        "op": result.op,
        "family": family_of(identifier),
        "status": result.status,
        "correct": result.correct,
        "vectorized": result.vectorized,
        "fallback_ops": sorted(result.fallback_ops),
        "aten_ops": dict(result.aten_ops),
        "messages": list(result.messages),
        "checks": result.checks,
        "seconds": result.seconds,
    }


def run(identifiers, samples, jobs, inplace=False):
    work = [(identifier, samples, inplace) for identifier in identifiers]
    if jobs <= 1:
        return [_check(w) for w in work]
    with multiprocessing.get_context("fork").Pool(jobs, maxtasksperchild=100) as pool:
        return pool.map(_check, work, chunksize=4)


# -- rendering ------------------------------------------------------------------------------
_RESULT_WORDS = {
    "vectorized": "pass, vectorized",
    "factory": "pass, vectorized (no tensor input)",
    "random": "pass, vectorized (random: shapes checked)",
    "data_dependent": "pass (raises the data-dependent error)",
    "fallback": "pass, NOT vectorized (per-sample fallback)",
    "random_fallback": "pass, NOT vectorized (random, per-sample fallback)",
    "fail": "FAIL (wrong values)",
    "error": "FAIL (error)",
    "unsupported": "FAIL (unsupported input)",
    "no_samples": "skipped (no CPU float32 sample)",
}


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _name(text: str) -> str:
    """An op or overload name as inline code that may break after its "." and "::" but never
    inside a word (the long tables' narrow columns used to split names mid-word)."""
    import html

    escaped = html.escape(text)
    return "<code>" + escaped.replace("::", "::<wbr>").replace(".", ".<wbr>") + "</code>"


def _names(entries: list[tuple[str, str]], limit: int) -> str:
    """`name (how), ...` for (name, how) pairs, cut after `limit` characters of text."""
    shown, length = [], 0
    for name, how in entries:
        if shown and length + len(name) + len(how) > limit:
            shown.append(f"… ({len(entries) - len(shown)} more)")
            break
        shown.append(f"{_name(name)} ({how})" if how else _name(name))
        length += len(name) + len(how) + 5
    return ", ".join(shown)


def _overload(name: str):
    import torch

    namespace, rest = name.split("::")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def _rule_file(name: str, how: str) -> str:
    from functx.vmap import VMAP_RULES

    if how != "rule":
        return ""
    op = _overload(name)
    rule = VMAP_RULES.rules.get(op) if op is not None else None
    module = getattr(rule, "__module__", "") or ""
    return module.rsplit(".", 1)[-1]


def _jvp_how(name: str) -> str:
    """How a wrapped jvp level handles the overload (`JVP_RULES.how`): rule, template, or
    default (torch's own formula on transient duals)."""
    from functx.ad.jvp_rules import JVP_RULES

    op = _overload(name)
    return JVP_RULES.how(op) if op is not None else ""


def _note(r, expected_failures, not_vectorized) -> str:
    """Why an op is where it is: the ops it loops over, and the test list's reason."""
    note = "per-sample loop: " + ", ".join(r["fallback_ops"]) if r["fallback_ops"] else ""
    reason = expected_failures.get(r["op"]) or not_vectorized.get(r["op"])
    if reason:
        note = f"{note}; {reason}" if note else reason
    elif r["messages"] and (not r["correct"] or r["status"] == "data_dependent"):
        note = r["messages"][0]
    return note


# The ops a reader looks for first, in this order: those that run once per sample, those
# vmap refuses (a value-dependent shape, with the fallback off), those that fail.
_EXCEPTIONS = (("fallback", "random_fallback"), ("data_dependent",), ("fail", "error", "unsupported"))


def summarize(results):
    counted = [r for r in results if r["status"] != "no_samples"]
    good = [r for r in counted if r["vectorized"]]
    families = collections.defaultdict(list)
    for r in counted:
        families[r["family"]].append(r)
    return counted, good, families


def render(results, inplace_results, samples, seconds) -> str:
    import torch

    from tests.vmap.test_op_db import EXPECTED_FAILURES, NOT_VECTORIZED

    counted, good, families = summarize(results)
    statuses = collections.Counter(r["status"] for r in results)
    lines = [
        "---",
        "hide:",
        "  - navigation  # the room goes to the long tables",
        "---",
        "",
        "# vmap coverage of torch's op database",
        "",
        "<!-- Generated by scripts/coverage_table.py; do not edit by hand. -->",
        f"Generated by `scripts/coverage_table.py`; regenerate with `{REGENERATE}`.",
        "",
        f"torch {torch.__version__}; every OpInfo of "
        "`torch.testing._internal.common_methods_invocations.op_db` with float32 CPU samples; "
        f"up to {samples} samples per op, batch size 3 (three independently drawn samples, "
        "stacked). Each sample is checked with the batch at dim 0, at a trailing dim, and "
        "with each of its first three tensor arguments unbatched, against a per-sample loop "
        "of the op, first with the per-sample fallback switched off "
        f"(`functx.vmap_fallback(\"error\")`). Sweep time: {seconds:.0f} s.",
        "",
        "## Summary",
        "",
        f"**Correct and vectorized: {len(good)} / {len(counted)} ops "
        f"({len(good) / max(len(counted), 1):.1%})** "
        f"(ops without a CPU float32 sample are not counted: {statuses.get('no_samples', 0)}).",
        "",
        "| result | ops |",
        "|---|---|",
    ]
    for status, words in _RESULT_WORDS.items():
        if statuses.get(status):
            lines.append(f"| {words} | {statuses[status]} |")
    exceptions = [r for group in _EXCEPTIONS for r in results if r["status"] in group]
    lines += [
        "",
        "## Not vectorized, refused or failing",
        "",
        f"The {len(exceptions)} ops that are not simply correct and vectorized: those vmap runs "
        "once per sample (correct, slower; a `PerformanceWarning` says so), those whose output "
        "shape depends on the values (with the per-sample fallback switched off vmap raises the "
        "data-dependent error; by default it runs them per sample), and those that fail. "
        "Every other op below is correct and vectorized.",
        "",
        "| op | family | result | why |",
        "|---|---|---|---|",
    ]
    for r in exceptions:
        note = _note(r, EXPECTED_FAILURES, NOT_VECTORIZED)
        lines.append(f"| {_name(r['op'])} | {r['family']} | {_RESULT_WORDS[r['status']]} | {_cell(note, 300) or '-'} |")
    lines += [
        "",
        "## By family",
        "",
        "| family | ops | correct and vectorized | % | not vectorized | failing |",
        "|---|---|---|---|---|---|",
    ]
    for family, rs in sorted(families.items()):
        ok = sum(r["vectorized"] for r in rs)
        slow = [r["op"] for r in rs if r["correct"] and not r["vectorized"]]
        bad = [r["op"] for r in rs if not r["correct"]]
        lines.append(
            f"| {family} | {len(rs)} | {ok} | {ok / len(rs):.0%} | {_cell(', '.join(slow), 300) or '-'} | "
            f"{_cell(', '.join(bad), 300) or '-'} |"
        )
    inplace_counted, inplace_good, _ = summarize(inplace_results)
    lines += [
        "",
        "## In-place variants",
        "",
        f"The op's in-place variant (`x.add_(y)`, batched `self`; an unbatched `self` with batched "
        f"arguments must raise): **{len(inplace_good)} / {len(inplace_counted)} correct and vectorized**.",
        "",
    ]
    for r in inplace_results:
        if r["status"] != "no_samples" and not r["vectorized"]:
            detail = ", ".join(r["fallback_ops"]) or (r["messages"][0] if r["messages"] else "")
            lines.append(f"- `{r['op']}`: {_RESULT_WORDS[r['status']]}: {_cell(detail, 240)}")
    lines += [
        "",
        "## Per op",
        "",
        "Every op of the sweep (the table filters and sorts: type an op name, a family, "
        "`fallback` or `FAIL`; click a column's header). "
        "How: the aten overloads that reached vmap while running the op, and how `VMAP_RULES` "
        "handles each (`VMAP_RULES.how(op)`): rule, template (every Tag.pointwise op, "
        "elementwise prims, in-place ops through their functional op's rule, data-dependent "
        "ops), decomposition (torch._decomp or the op's CompositeImplicit kernel, re-dispatched), "
        "fallback (per-sample loop), missing.",
        "",
        "| op | family | result | aten overloads (how) | note |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        reached = _names(sorted(r["aten_ops"].items()), 400)
        note = _note(r, EXPECTED_FAILURES, NOT_VECTORIZED)
        lines.append(
            f"| {_name(r['op'])} | {r['family']} | {_RESULT_WORDS[r['status']]} | {reached or '-'} | "
            f"{_cell(note, 240) or ''} |"
        )
    overloads = collections.defaultdict(lambda: ["", set()])
    for r in results:
        for name, how in r["aten_ops"].items():
            overloads[name][0] = how
            overloads[name][1].add(r["op"])
    if not overloads:  # the recorder (tests/vmap/opdb_support.record_vmap_ops) saw nothing
        raise RuntimeError("no aten overload reached a vmap level during the sweep: the recorder is broken")
    lines += [
        "",
        "## Per aten overload",
        "",
        f"{len(overloads)} aten overloads reached a vmap level during the sweep. `jvp`: how a "
        f"wrapped jvp level handles the same overload (`JVP_RULES.how`, functx/ad/jvp_rules.py): "
        f"its own rule, a template (views, value-free ops, in-place views) or the default "
        f"(torch's own forward formula on duals made for that op).",
        "",
        "| aten overload | how | rule file | jvp | reached from (op_db ops) |",
        "|---|---|---|---|---|",
    ]
    for name, (how, ops) in sorted(overloads.items()):
        names = sorted(ops)
        shown = ", ".join(names[:6]) + (f", … ({len(names)} ops)" if len(names) > 6 else "")
        lines.append(f"| {_name(name)} | {how} | {_rule_file(name, how)} | {_jvp_how(name)} | {_cell(shown, 300)} |")
    return "\n".join(lines) + "\n"


def print_summary(results, stream=sys.stdout):
    counted, good, families = summarize(results)
    print(f"correct and vectorized: {len(good)}/{len(counted)} = {len(good) / max(len(counted), 1):.1%}", file=stream)
    for family, rs in sorted(families.items()):
        ok = sum(r["vectorized"] for r in rs)
        print(f"  {family:12s} {ok:4d}/{len(rs):<4d} {ok / len(rs):.0%}", file=stream)
    for r in results:
        if not r["vectorized"] and r["status"] != "no_samples":
            first = r["messages"][0] if r["messages"] else ", ".join(r["fallback_ops"])
            print(f"  {r['status']:16s} {r['op']}: {_cell(first, 200)}", file=stream)


def main(argv=None):
    from tests.vmap.opdb_support import float32_ops, op_id
    from tests.vmap.test_op_db import FULL_SAMPLES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=FULL_SAMPLES, help="samples per op (default: the full sweep's)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (the machine is shared: 2 at most)")
    parser.add_argument("--ops", nargs="*", help="only these op ids (for debugging)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--stdout", action="store_true", help="print the table instead of writing it")
    parser.add_argument("--summary", action="store_true", help="print the fractions only")
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args(argv)

    ops = [op for op in float32_ops() if not args.ops or op_id(op) in set(args.ops)]
    identifiers = [op_id(op) for op in ops]
    start = time.perf_counter()
    results = run(identifiers, args.samples, args.jobs)
    inplace_results = run([op_id(op) for op in ops if op.inplace_variant is not None], args.samples, args.jobs, True)
    seconds = time.perf_counter() - start
    print_summary(results, sys.stderr)
    inplace_counted, inplace_good, _ = summarize(inplace_results)
    print(f"in-place variants correct and vectorized: {len(inplace_good)}/{len(inplace_counted)}", file=sys.stderr)
    if not args.summary:
        text = render(results, inplace_results, args.samples, seconds)
        if args.stdout:
            sys.stdout.write(text)
        else:
            with open(args.output, "w") as f:
                f.write(text)
            print(f"wrote {os.path.relpath(args.output, ROOT)} ({seconds:.0f} s)", file=sys.stderr)
    counted, good, _ = summarize(results)
    return 0 if len(good) >= args.target * len(counted) else 1


if __name__ == "__main__":
    sys.exit(main())
