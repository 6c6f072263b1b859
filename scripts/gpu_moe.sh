#!/usr/bin/env bash
# One device call's worth of MoE-layer work (issues 3 and 5): re-tune the large-T launch
# configurations (tile order and the grouped_mm down GEMM included), the per-kernel
# breakdown at large T beside torch._grouped_mm, bench_moe at large T, the OLMoE prefill
# with its kernel profile, and the GPU tests of the MoE kernels' large-T paths. Logs go
# to OUT (default $OUT, else bench/results/sweep); the step limits add up to under 10
# minutes, one device call.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_moe.sh [OUT]
set -uo pipefail
out=${1:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
TAIL=14 step tune 150 python scripts/tune_moe.py --shapes qwen3,olmoe --tokens 1024,4096,16384 --int8-tokens ""
cp kernels/configs/moe.json "$out/moe-table.json"
TAIL=40 step diag 80 python scripts/diag_moe.py --shapes qwen3-30b-a3b,olmoe --tokens 4096,16384
TAIL=14 step large_t 90 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 \
    --tokens 1024,4096,16384 --dtypes bf16 --no-baselines --no-json
TAIL=30 step prefill 120 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 8 --reps 3 \
    --prefill 2048:8,512:8 --profile
TAIL=4 step gpu_tests 120 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_moe_kernels.py \
    -k "tile_order or grouped_mm or maps or 4097 or 511"
tar czf /tmp/moe.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/moe.tgz "$out/"
exit 0
