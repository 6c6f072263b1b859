#!/usr/bin/env bash
# Sets up the test environment and runs the test suite: the multi-rank tests under mpiexec
# with 2 and 4 ranks (gloo on CPU), then the main suite last. GPU tests skip themselves
# without a GPU. Extra arguments go to the main pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
py=${PYTHON:-python3}
for ranks in 2 4; do
    echo "== mpi tests, $ranks ranks"
    # One thread per rank: 4 ranks on a 2-core machine, each spinning several OpenMP
    # threads, can be ten times slower.
    OMP_NUM_THREADS=1 timeout 300 mpiexec -n "$ranks" $py -m pytest -q --color=no -p no:cacheprovider -m mpi \
        tests/test_comm_mpi.py tests/test_model_mpi.py
done
echo "== main test suite"
exec $py -m pytest -q --color=no "$@"
