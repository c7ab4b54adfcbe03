"""functx/core/op_facts.py: the one reader of what schemas say about aliasing and mutation."""

import pathlib
import re

import pytest
import torch

from functx.core import op_facts

aten = torch.ops.aten
ROOT = pathlib.Path(__file__).resolve().parents[2] / "functx"


def test_schemas_aliasing_is_read_in_op_facts_only():
    readers = [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if path.name != "op_facts.py" and re.search(r"alias_info|Tag\.inplace_view", path.read_text())
    ]
    assert readers == [], f"read what a schema says through functx/core/op_facts.py, not in {readers}"


@pytest.mark.parametrize(
    "op, mutated, out, inplace_view, view_of_first, view",
    [
        (aten.add.Tensor, None, False, False, False, False),
        (aten.add_.Tensor, 0, False, False, False, False),
        (aten.add.out, None, True, False, False, False),
        (aten.squeeze_.dim, 0, False, True, False, False),
        (aten.transpose.int, None, False, False, True, True),
        (aten.split.Tensor, None, False, False, True, True),
        (aten.detach.default, None, False, False, False, True),
        (aten.max.dim_max, None, True, False, False, False),
    ],
)
def test_facts_of_known_ops(op, mutated, out, inplace_view, view_of_first, view):
    assert op_facts.mutated_argument(op) == mutated
    assert op_facts.writes_out(op) is out
    assert op_facts.writes_any(op) is (mutated is not None or out)
    assert op_facts.is_inplace_view(op) is inplace_view
    assert op_facts.is_view_of_first(op) is view_of_first
    assert op_facts.is_view(op) is view


def test_every_in_place_overload_writes_its_self():
    # against torch's own naming: an overload tagged `inplace` (add_, mul_...) writes argument 0
    checked = 0
    for name in ("add_", "mul_", "sin_", "clamp_", "index_fill_", "masked_fill_", "copy_"):
        for overload in getattr(aten, name).overloads():
            op = getattr(getattr(aten, name), overload)
            if str(op._schema.arguments[0].type) != "Tensor":  # (`add_.t`: a list's append)
                continue
            assert op_facts.mutated_argument(op) == 0, op
            checked += 1
    assert checked > 10
