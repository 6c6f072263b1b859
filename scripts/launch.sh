#!/usr/bin/env bash
# Starts a multi-rank moe-infer job:  scripts/launch.sh -n 4 -- moe-infer generate --tp 2 --ep 2 --prompt ...
# CPU hosts use the MPI runtime from PyPI (mpich's mpiexec, gloo); GPU hosts Open MPI's
# mpirun (NCCL), with NVLink multicast kept off in every rank. Ranks are not bound to cores:
# Open MPI binds each of a few ranks to one core by default, which would put a server's HTTP
# workers, its clients and the rank's own host thread on a single core.
set -euo pipefail
usage() { echo "usage: $0 -n RANKS -- COMMAND [ARGS...]" >&2; exit 2; }
[ "${1:-}" = "-n" ] && [ -n "${2:-}" ] && [ "${3:-}" = "--" ] || usage
ranks=$2
shift 3
[ $# -gt 0 ] || usage
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    exec mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$ranks" \
        -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PATH -x PYTHONPATH "$@"
fi
exec mpiexec -n "$ranks" "$@"
