#!/usr/bin/env bash
# The GPU check in one command, for the day a GPU is lent (issue 32): under 8 minutes.
#
#   scripts/device_check.sh [OUT]     results in OUT (default: $OUT, else ./device_check_out)
#
# It sets up from the repository alone (a lent machine may reach no package index): functx
# from this checkout on PYTHONPATH, over the machine's own torch (and Triton, pytest where
# present). Then:
#   1. tests/cuda: every transform and the model zoo's workloads on CUDA against the CPU,
#      autograd's device threads seeing the user's levels, the Triton kernels compiled for
#      the GPU against the torch path (at most 180 s);
#   2. scripts/gpu_check.py --skip-suite: the environment, the Triton kernels at larger
#      shapes, and timings alternated with torch.func in one process: DP-SGD steps,
#      per-sample gradients, functx.jit against torch.compile (at most 270 s);
#   3. the report, OUT/device_check.md (record its numbers in benchmarks/GPU.md).
# DEVICE_CHECK_DEVICE=cpu runs the same on the CPU: a smoke run of the script itself.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device_check_out}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
device="${DEVICE_CHECK_DEVICE:-cuda}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "$device" = cpu ] && export FUNCTX_CUDA_TESTS_DEVICE=cpu
start=$SECONDS
{
  echo "# functx device check ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), device $device)"
  echo
  echo "## tests/cuda"
  timeout 180 "$python" -m pytest -q -p no:cacheprovider -rfEs tests/cuda > "$out/tests_cuda.log" 2>&1
  echo "- exit $?; $(tail -n 1 "$out/tests_cuda.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$out/tests_cuda.log" | head -40 | sed 's/^/  - /'
  echo
  timeout 270 "$python" scripts/gpu_check.py --out "$out" --skip-suite --rounds 11 --device "$device" > "$out/gpu_check.log" 2>&1
  echo "- gpu_check exit $?"
  cat "$out/gpu_check.md" 2>/dev/null || tail -n 40 "$out/gpu_check.log"
  echo
  echo "total: $((SECONDS - start)) s"
} | tee "$out/device_check.md"
