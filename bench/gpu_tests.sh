#!/usr/bin/env bash
# One call on a CUDA machine: the strict-kernel test set on the GPU, then (unless --tests-only) the
# kernel benchmark. Needs python3 with torch, triton, pytest, hypothesis, pandas (the device image has them).
#   bench/gpu_tests.sh [--tests-only] [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.}
shim=$(mktemp -d)
ln -s "$PWD/kernels" "$shim/alignaudit_kernels"  # the import name setuptools maps kernels/ to
export PYTHONPATH="$shim:$PWD:${PYTHONPATH:-}"
python3 -c "import torch, triton; print('gpu', torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py --kernel-device cuda -rs 2>&1 | tee "$out/gpu-kernel-tests.log"
status=${PIPESTATUS[0]}
if [ "${1:-}" != "--tests-only" ]; then
  python3 bench/kernels_gpu.py "$@" --json "$out/gpu-kernel-bench.json" 2>&1 | tee "$out/gpu-kernel-bench.log"
fi
exit "$status"
