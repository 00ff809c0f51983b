#!/usr/bin/env bash
# One GPU, one table: the CUDA paths of every feature, the attention kernels, offload, LoRA SFT, two ranks on one
# device, bf16 speed and MFU against plain PyTorch, memory vs the planner, fp8 speed against bf16.
#
#   benchmarks/gpu_check.sh                       # the GPU run: < 6 minutes on one H200 (about 5-5.5 expected)
#   benchmarks/gpu_check.sh --cpu                 # self-test: every row at tiny sizes on the CPU (or GPU_CHECK_CPU=1)
#   benchmarks/gpu_check.sh --json out.json --only features attention
#
# Needs only `pip install torch -e .[dev]`: nothing is downloaded (synthetic tokens, presets' shapes, random weights).
# The driver, benchmarks/gpu_check.py (run as python -m benchmarks.gpu_check), documents each row and its time budget; this wrapper checks the machine, sets
# the environment and bounds the whole run with `timeout` (GPU_CHECK_TIMEOUT seconds, default 350; the driver's own
# budget, --budget 330, makes it print its table before that).
set -euo pipefail
cd "$(dirname "$0")/.."

cpu=${GPU_CHECK_CPU:-0}
for arg in "$@"; do
  [[ $arg == --cpu ]] && cpu=1
done

python=${PYTHON:-python}
if [[ $cpu != 1 ]]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi on PATH: not a GPU machine? (run with --cpu for the smoke mode)" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
  if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $("$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)') cannot use the GPU (a CPU build of torch?)" >&2
    exit 2
  fi
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore          # Lightning's advice lines would bury the table
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # nothing is downloaded; fail fast if something tries
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
[[ $cpu == 1 ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} GPU_CHECK_CPU=1

exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-350}" "$python" -m benchmarks.gpu_check "$@"
