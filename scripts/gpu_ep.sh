#!/usr/bin/env bash
# One device call's worth of multi-GPU checks and measurements (issue 4): the mpi tests
# under NCCL at RANKS ranks, scripts/bench_ep.py, and scripts/diag_ep.py (each step of the
# dispatch and combine on its own). Logs go to OUT (default $OUT, else bench/results/ep-sweep), packed into one archive.
#
#   PYTHONPATH=. MOE_INFER_COMMIT=<hash> scripts/gpu_ep.sh RANKS [OUT]
set -uo pipefail
ranks=${1:?usage: $0 RANKS [OUT]}
out=${2:-${OUT:-bench/results/ep-sweep}}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
here=$(dirname "$0")
. "$here/device_step.sh"
nvidia-smi topo -m > "$out/topo.log" 2>&1
TAIL=6 step mpi_tests 240 "$here/launch.sh" -n "$ranks" -- python -m pytest -q -p no:cacheprovider --color=no \
    -m mpi tests/test_comm_mpi.py tests/test_model_mpi.py
TAIL=45 step bench_ep 240 "$here/launch.sh" -n "$ranks" -- python scripts/bench_ep.py --reps 30
find bench/results -newer "$out/topo.log" -name 'ep-*.json' -print0 | xargs -0 cp -t "$out" 2>/dev/null
TAIL=40 step diag_ep 90 "$here/launch.sh" -n "$ranks" -- python scripts/diag_ep.py --tokens 64,512,4096
tar czf /tmp/ep-sweep.tgz -C "$out" . && rm -f "$out"/* && mv /tmp/ep-sweep.tgz "$out/"
exit 0
