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
    # threads, can be ten times slower. A run that times out is tried once more: on a
    # loaded 2-core machine one of 4 gloo ranks was seen stuck inside a test the other three
    # had passed (3 of 20 runs); a hang that repeats still fails here, and
    # any test failure fails at once.
    # The limit grows with the ranks (they share the cores): it catches hangs, not slow runs
    # (on two cores the suites take about 70 s at 2 ranks and 100 s at 4).
    # At 4 ranks the tests of scheduling over ranks (pipeline slots, dp-attention replicas,
    # offload under ep, served pipelines) run for one family, with latent attention, and
    # test_layouts_match's every 4-rank layout for three (a shared expert, latent attention,
    # experts weighted on their input); every family runs them all at 2 ranks.
    only=()
    four="(layouts_match and not (olmoe or gpt_oss)) or not (olmoe or gpt_oss or llama4_text or qwen2_moe)"
    [ "$ranks" -eq 4 ] && only=(-k "$four")
    for attempt in 1 2; do
        rc=0
        # (a test past 120 s prints every thread's stack: where a hang waits)
        OMP_NUM_THREADS=1 timeout $((120 * ranks)) mpiexec -n "$ranks" $py -m pytest -q --color=no -p no:cacheprovider \
            -o faulthandler_timeout=120 -m mpi "${only[@]}" \
            tests/test_comm_mpi.py tests/test_dispatch_mpi.py tests/test_model_mpi.py || rc=$?
        [ "$rc" -eq 124 ] && [ "$attempt" -eq 1 ] && { echo "== mpi tests, $ranks ranks: timed out, once more"; continue; }
        [ "$rc" -eq 0 ] || exit "$rc"
        break
    done
done
echo "== main test suite"
# Two workers (pytest-xdist): most tests hold one core (the Triton interpreter, a tiny
# model's Python), and the subprocess tests wait on their children. One thread each:
# two workers' thread teams on two cores spin against each other in every small op.
OMP_NUM_THREADS=1 exec $py -m pytest -q --color=no -n 2 "$@"
