"""Every functx warning names the user's line (core/errors.py `warn`), not functx's or
torch's file: the caller's file and line are what a user reads first, and what
`warnings.filterwarnings(module=...)` keys on. Each case triggers one warning from this file
and checks the recorded filename and line."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
import torch

import functx
from functx.staging.jit import RETRACE_WARNING_AFTER, RetraceWarning
from functx.vmap import custom_function
from tests.autograd_functions import OldStyleSTE


@torch.library.custom_op("functx_tests_warnings::numpy_sin", mutates_args=())
def numpy_sin(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.sin(x.detach().numpy()))


numpy_sin.register_fake(lambda x: torch.empty_like(x))
numpy_sin.register_autograd(
    lambda ctx, g: g * ctx.x.cos(), setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
)


@torch.library.custom_op("functx_tests_warnings::numpy_cos", mutates_args=())
def numpy_cos(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.cos(x.detach().numpy()))


numpy_cos.register_fake(lambda x: torch.empty_like(x))
numpy_cos.register_autograd(
    lambda ctx, g: -g * ctx.x.sin(), setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0])
)

X = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64)
ONES = torch.ones(3, dtype=torch.float64)


def _vmap_fallback():
    functx.vmap(numpy_sin)(X[:, None].expand(3, 2).contiguous())


def _vmap_old_style_function():
    custom_function._warned.discard(OldStyleSTE)  # it warns once per Function: other tests may have
    functx.vmap(OldStyleSTE.apply)(X)


def _vmap_data_dependent():
    functx.vmap(lambda x: x * 2 if x.sum() > 0 else x)(X)


def _jvp_whole_function():
    functx.jvp(numpy_sin, (X,), (ONES,))


def _jvp_one_op():  # a tracked primal: the wrapped level takes the identity on the op alone
    functx.jvp(lambda x: numpy_sin(x) * 2, (X.clone().requires_grad_(),), (ONES,))


def _jet_fallback():  # (an op of this file: the fallback warns once per op and process)
    functx.jet(lambda x: numpy_cos(x * 1.5), (X,), ((ONES,),))


def _retrace():
    f = functx.jit(lambda x: functx.grad(lambda y: y.pow(3).sum())(x))
    for n in range(1, RETRACE_WARNING_AFTER + 1):
        f(torch.ones(n))


def _einops_keyword_axis():
    functx.rearrange(torch.ones(2, 3), "lambda b -> b lambda")


CASES = {
    "vmap's per-sample fallback": (_vmap_fallback, functx.PerformanceWarning),
    "vmap of an old-style Function": (_vmap_old_style_function, functx.PerformanceWarning),
    "vmap over a data-dependent branch": (_vmap_data_dependent, functx.PerformanceWarning),
    "jvp by the double-VJP identity, whole function": (_jvp_whole_function, functx.PerformanceWarning),
    "jvp by the double-VJP identity, one op": (_jvp_one_op, functx.PerformanceWarning),
    "jet's nested forward fallback": (_jet_fallback, functx.PerformanceWarning),
    "jit retracing": (_retrace, RetraceWarning),
    "einops keyword axis": (_einops_keyword_axis, RuntimeWarning),
}


@pytest.mark.parametrize("case", CASES)
def test_warning_names_the_users_line(case):
    trigger, category = CASES[case]
    source, first = inspect.getsourcelines(trigger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trigger()
    ours = [w for w in caught if issubclass(w.category, category)]
    assert ours, f"no {category.__name__} from {case}: {[str(w.message)[:80] for w in caught]}"
    for w in ours:
        assert w.filename == __file__, f"{case}: the warning names {w.filename}:{w.lineno}, not this file"
        assert first <= w.lineno < first + len(source), f"{case}: line {w.lineno}, not in {trigger.__name__}"


def test_functx_warns_only_through_errors_warn():
    """A new warning written with `warnings.warn` and a fixed stacklevel would point into
    functx again when called from another depth: every warning goes through `warn`."""
    import pathlib

    root = pathlib.Path(functx.__file__).parent
    direct = [
        f"{path.relative_to(root)}:{number}"
        for path in root.rglob("*.py")
        if path.name != "errors.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "warnings.warn(" in line
    ]
    assert direct == [], f"use functx.core.errors.warn: {direct}"
