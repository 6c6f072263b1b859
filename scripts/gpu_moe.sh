#!/usr/bin/env bash
# One device call's worth of MoE-layer work (issue 3): re-tune the large-T launch
# configurations (tile order included), the per-kernel breakdown at large T beside
# torch._grouped_mm, bench_moe at large T and at decode sizes (bf16 and int8), and the
# GPU tests of the MoE kernels' large-T path. Logs go to OUT (default $OUT, else
# bench/results/sweep); the step limits add up to under 10 minutes, one device call.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_moe.sh [OUT]
set -uo pipefail
out=${1:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
TAIL=30 step tune 200 python scripts/tune_moe.py --shapes qwen3,olmoe,dsmoe --tokens 1024,4096,16384 --int8-tokens ""
cp kernels/configs/moe.json "$out/moe-table.json"
TAIL=40 step diag 80 python scripts/diag_moe.py --shapes qwen3-30b-a3b,olmoe --tokens 4096,16384
TAIL=20 step large_t 90 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe,ds-moe-1.3b-e128 \
    --tokens 1024,4096,16384 --dtypes bf16 --no-baselines --no-json
TAIL=40 step decode 110 python scripts/bench_moe.py --tokens 1,8 --no-baselines --no-json
TAIL=4 step gpu_tests 80 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_moe_kernels.py \
    -k "tile_order or 4097"
tar czf /tmp/moe.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/moe.tgz "$out/"
exit 0
