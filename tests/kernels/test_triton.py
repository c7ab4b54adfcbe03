"""functx/kernels/triton_kernels.py: the Triton kernels (ghost norm, LayerNorm affine
gradients, embedding norms), run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1,
set before triton is imported: a fresh process), against materialised per-sample gradients
and per-sample autograd loops; float32 and float64; tiles on and off the diagonal, ragged
edges, one step, empty sequences, repeated and padding ids; and the operators' CUDA kernel
functions choosing them. The cases are tests/kernels/triton_cases.py's, which
scripts/gpu_check.py runs on CUDA tensors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = "from tests.kernels.triton_cases import check_kernels; print(check_kernels('cpu'), 'ok')"


def test_ghost_norm_kernel_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
