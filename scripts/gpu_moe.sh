#!/usr/bin/env bash
# One device call's worth of checks and measurements for the prefill and large-T work
# (issues 3 and 5): the GPU tests of the fused QKV epilogue, the engine and checkpoint
# parity; the OLMoE prefill with its kernel profile; bench_moe at large T with
# programmatic dependent launch off and on. Logs go to OUT (default $OUT, else
# bench/results/sweep); the step limits add up to under 10 minutes, one device call.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_moe.sh [OUT]
set -uo pipefail
out=${1:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
TAIL=30 step prefill 130 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1 --new-tokens 8 --reps 3 \
    --prefill 2048:8,512:8 --profile
TAIL=4 step gpu_tests 220 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_fused_decode.py \
    tests/test_engine.py tests/test_default_model.py tests/test_parity.py
for pdl in 0 1; do
    MOE_INFER_PDL=$pdl TAIL=8 step large_t_pdl$pdl 70 python scripts/bench_moe.py --shapes qwen3-30b-a3b,olmoe \
        --tokens 4096,16384 --dtypes bf16 --no-baselines --no-json
done
tar czf /tmp/moe.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/moe.tgz "$out/"
exit 0
