#!/usr/bin/env bash
# One device call's worth of checks and measurements for the dense decode path (issue 5):
# the GPU tests of the new kernels and of graph decode, the dense-kernel sweep (which also
# writes kernels/configs/dense.json, the per-shape GEMM table), and decode per token with
# its floor and the transformers peer. Logs go to OUT (default $OUT, else bench/results/sweep).
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
step diag_launch 40 python scripts/diag_launch.py
step gpu_tests 160 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_quant.py \
    tests/test_decode_attention.py tests/test_sbi_gemm.py tests/test_engine.py
step bench_dense 200 python scripts/bench_dense.py --write-table --models mixtral-8x7b,qwen3-30b-a3b,gpt-j-6b
step decode_default 60 python scripts/bench_decode.py --peer
step decode_olmoe 130 python scripts/bench_decode.py --model olmoe-1b-7b --batches 1,8 --new-tokens 64 --reps 3 --peer
cp bench/results/*.json kernels/configs/dense.json "$out/" 2>/dev/null
exit 0
