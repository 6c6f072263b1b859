#!/usr/bin/env bash
# One device call's worth of checks and measurements for the dense decode path (issue 5):
# the GPU tests of the fused decode kernels and of graph decode; decode per token with its floor, a per-kernel profile of the step, the
# transformers peer and prefill rates (OLMoE bf16 and int8, Qwen3-30B-A3B, the embedded
# model). Logs go to OUT (default $OUT, else bench/results/sweep). The step limits add up
# to under 10 minutes, one device call.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sweep.sh [OUT]
set -uo pipefail
out=${1:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
TAIL=4 step gpu_tests 100 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_fused_decode.py \
    tests/test_engine.py tests/test_default_model.py
TAIL=25 step decode_olmoe 170 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 64 \
    --reps 3 --profile --peer
TAIL=6 step decode_olmoe_int8 60 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 64 \
    --reps 3 --quantize int8
TAIL=20 step decode_qwen3 110 python scripts/bench_decode.py --model qwen3-30b-a3b --batches 1,8 --new-tokens 64 \
    --reps 3 --profile
TAIL=6 step decode_default 40 python scripts/bench_decode.py --batches 1 --new-tokens 64 --reps 3
TAIL=6 step prefill_olmoe 60 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 8 \
    --reps 3 --prefill 2048:8,512:8
# One archive back: the logs, this run's result files and the GEMM table.
find bench/results -newer "$out/gpu_tests.log" -name '*.json' -print0 | xargs -0 cp -t "$out" 2>/dev/null
cp kernels/configs/dense.json "$out/dense-table.json"
tar czf /tmp/sweep.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/sweep.tgz "$out/"
exit 0
