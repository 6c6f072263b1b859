#!/usr/bin/env bash
# One device call's worth of checks and measurements for the dense decode path (issue 5):
# the GPU tests of the new kernels and of graph decode, and decode per token with
# its floor, the transformers peer and a per-kernel profile of the step. Logs go to OUT
# (default $OUT, else bench/results/sweep).
# The step limits add up to under 10 minutes, one device call.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_sweep.sh [OUT]
set -uo pipefail
out=${1:-${OUT:-bench/results/sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
step() {  # name, timeout in seconds, command...: runs it, logs it, prints its tail
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: rc $?"
    tail -n 25 "$out/$name.log"
}
step gpu_tests 150 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_fused_decode.py \
    tests/test_engine.py tests/test_quant.py tests/test_default_model.py
step decode_default 60 python scripts/bench_decode.py --batches 1,8 --new-tokens 64 --reps 3 --profile
step decode_olmoe 200 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 64 --reps 3 \
    --profile --peer --prefill 2048:8,512:8,128:32
cp bench/results/*.json "$out/" 2>/dev/null
exit 0
