"""Property tests: random in_dims / out_dims / nesting depth, vmap against a loop."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functx import vmap


def loop_vmap(f, in_dims, out_dim):
    """The reference vmap: a Python loop over the mapped dim, outputs stacked at out_dim."""

    def run(*args):
        size = next(a.size(d) for a, d in zip(args, in_dims) if d is not None)
        outs = [f(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims))) for i in range(size)]
        return torch.stack(outs, dim=out_dim)

    return run


# Body functions of two same-shape arguments (logical shape (3, 4) at the innermost level).
BODIES = {
    "mul_sin": lambda a, b: a.sin() * b,
    "sum_dim": lambda a, b: (a + b).sum(-1),
    "transpose_mm_like": lambda a, b: (a.t() * 2).sum(0) + b.mean(0).sum(),
    "softmax_sub": lambda a, b: a.softmax(0) - b,
    "reshape_cumsum": lambda a, b: (a * b).reshape(12).cumsum(0),
    "where_max": lambda a, b: torch.where(a > b, a, b).amax(0),
    "view_write": lambda a, b: a.clone().index_fill_(0, torch.tensor([1]), 0.0) + b,
}


@st.composite
def nested_case(draw):
    depth = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(depth)]
    levels = []  # outermost first
    for size in sizes:
        dims = tuple(draw(st.sampled_from([None, 0, 1, -1])) for _ in range(2))
        if dims == (None, None):
            dims = (0, dims[1])
        levels.append((size, dims, draw(st.sampled_from([0, -1]))))
    body = draw(st.sampled_from(sorted(BODIES)))
    return levels, body


def _physical_inputs(levels, generator):
    """Build the two inputs: insert each level's batch dim (outermost last inserted)."""
    shapes = [[3, 4], [3, 4]]
    for size, dims, _ in reversed(levels):
        for k, d in enumerate(dims):
            if d is None:
                continue
            pos = d if d >= 0 else len(shapes[k]) + 1 + d
            shapes[k].insert(pos, size)
    return [torch.randn(*s, generator=generator) for s in shapes]


@settings(max_examples=60, deadline=None)
@given(nested_case(), st.integers(0, 2**16))
def test_nested_vmap_matches_nested_loops(case, seed):
    levels, body = case
    generator = torch.Generator().manual_seed(seed)
    a, b = _physical_inputs(levels, generator)
    f_functx = f_loop = BODIES[body]
    for size, dims, out_dim in reversed(levels):  # innermost first
        f_functx = vmap(f_functx, in_dims=dims, out_dims=out_dim)
        f_loop = loop_vmap(f_loop, dims, out_dim)
    torch.testing.assert_close(f_functx(a, b), f_loop(a, b))
