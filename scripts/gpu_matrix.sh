#!/usr/bin/env bash
# The issue-5 table on one GPU: bench_decode.py --prompt-lens for each MODEL[:int8] given,
# each in its own process under a time limit (LIMIT seconds, default 280); logs and result
# JSON go to OUT (default $OUT, else bench/results/matrix). GPU_TESTS=1 first runs the GPU
# tests of the engine (graph decode, prefill in pieces).
#
#   PYTHONPATH=. scripts/gpu_matrix.sh mixtral-8x7b mixtral-8x7b:int8
set -uo pipefail
out=${OUT:-bench/results/matrix}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_step.sh"
start=$(date +%s)
if [ "${GPU_TESTS:-0}" = 1 ]; then
    TAIL=4 step gpu_tests_engine 150 python -m pytest -q -p no:cacheprovider --color=no -m gpu tests/test_engine.py
fi
for spec in "$@"; do
    model=${spec%%:*}
    quant=()
    [ "$spec" != "$model" ] && quant=(--quantize "${spec#*:}")
    TAIL=${TAIL_MATRIX:-16} step "matrix-$model${quant[1]:+-${quant[1]}}" "${LIMIT:-280}" python scripts/bench_decode.py \
        --model "$model" "${quant[@]}" --prompt-lens "${LENS:-128,512,2048}" --batches "${BATCHES:-1,8,32,64}" \
        --new-tokens "${NEW:-32}" --reps "${REPS:-3}" ${EXTRA:-}
done
find bench/results -maxdepth 1 -newermt "@$start" -name 'decode-matrix-*.json' -exec cp -t "$out" {} +
echo "== done in $(( $(date +%s) - start )) s"
