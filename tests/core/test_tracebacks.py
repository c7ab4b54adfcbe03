"""Errors read from the user's line (core/errors.py `user_facing`): a functx error's
traceback holds the user's frames (the call, and the user's own function a transform ran)
and one frame of functx's boundary, not the 5-8 internal frames it had (torch.func's stop at
the user's line). FUNCTX_SHOW_INTERNAL_FRAMES=1 keeps them all, for debugging functx."""

from __future__ import annotations

import traceback

import pytest
import torch

import functx
from functx.core.errors import SHOW_INTERNAL_FRAMES, internal_dirs

X = torch.ones(2, 3)


def _badly_shaped(x):
    return x.sum(0) @ torch.ones(5)  # the user's own bug: a shape mismatch inside the function


CASES = {
    "vmap: bad in_dims": lambda: functx.vmap(torch.sin, in_dims=3)(X),
    "grad: non-scalar output": lambda: functx.grad(torch.sin)(X),
    "grad_and_value: bad argnums": lambda: functx.grad_and_value(lambda x: x.sum(), argnums=4)(X),
    "jacrev: a non-tensor output": lambda: functx.jacrev(lambda x: 3)(X),
    "jacfwd: non-tensor primal": lambda: functx.jacfwd(torch.sin)(3.0),
    "hessian: bad argnums": lambda: functx.hessian(lambda x: x.sum(), argnums=2)(X),
    "vjp: non-tensor primal": lambda: functx.vjp(torch.sin, "x"),
    "vjp_fn: wrong cotangent shape": lambda: functx.vjp(torch.sin, X)[1](torch.ones(7)),
    "jvp: shapes differ": lambda: functx.jvp(torch.sin, (X,), (torch.ones(3),)),
    "linearize's jvp_fn: wrong tangent shape": lambda: functx.linearize(torch.sin, X)[1](torch.ones(7)),
    "functionalize: the user's bug": lambda: functx.functionalize(_badly_shaped)(X),
    "functional_call: unknown name": lambda: functx.functional_call(torch.nn.Linear(3, 2), {"nope": X}, (X,), strict=True),
    "jet: series not a list": lambda: functx.jet(torch.sin, (X,), (X,)),
    "vmap(grad(f)): the user's bug inside": lambda: functx.vmap(functx.grad(lambda x: _badly_shaped(x).sum()))(torch.ones(2, 3, 4)),
}
USER_BUG_INSIDE = ("functionalize: the user's bug", "vmap(grad(f)): the user's bug inside")


def _frames(case):
    with pytest.raises(Exception) as caught:
        CASES[case]()
    return caught.value, traceback.extract_tb(caught.value.__traceback__)


@pytest.mark.parametrize("case", CASES)
def test_traceback_shows_the_user_and_one_boundary_frame(case):
    error, frames = _frames(case)
    internal = [f for f in frames if f.filename.startswith(internal_dirs())]
    assert [(f.filename.endswith("errors.py"), f.name) for f in internal] == [(True, "call")], (
        f"{case}: internal frames {[(f.filename, f.name) for f in internal]}"
    )
    assert frames[0].filename == __file__  # pytest's frames above are outside this traceback
    if case in USER_BUG_INSIDE:
        assert frames[-1].name == "_badly_shaped"  # the user's own function, where it failed


def test_the_environment_variable_keeps_every_frame(monkeypatch):
    monkeypatch.setenv(SHOW_INTERNAL_FRAMES, "1")
    _, frames = _frames("vmap(grad(f)): the user's bug inside")
    assert len([f for f in frames if f.filename.startswith(internal_dirs())]) > 5


def test_error_type_message_and_cause_are_unchanged():
    error, _ = _frames("jvp: shapes differ")
    assert type(error) is RuntimeError and "same shape" in str(error)

    def raises_with_a_cause(x):
        try:
            {}["missing"]
        except KeyError as lookup:
            raise ValueError("the user's error") from lookup

    with pytest.raises(ValueError, match="the user's error") as caught:
        functx.vmap(functx.grad(raises_with_a_cause))(X)
    assert type(caught.value.__cause__) is KeyError
    assert caught.value.__suppress_context__  # `from` as the user wrote it
