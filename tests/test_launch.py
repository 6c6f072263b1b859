"""Launching under mpirun: a failing rank ends the whole job quickly, with its error."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec")

FAILING = """
import torch.distributed as dist
from comm import bootstrap
info = bootstrap(backend="gloo", timeout_s=600)  # longer than the test allows: the abort must end it
if info.rank == 1:
    raise RuntimeError("rank one fails on purpose")
dist.barrier()  # rank 0 would wait here forever without the abort
"""


def ends_within_60s(script: str, message: str, timeout: int = 90):
    """Runs ``script`` on 2 ranks through our launcher (mpich's mpiexec on CPU hosts, Open
    MPI's mpirun on GPU hosts): the job fails within 60 s with rank 1's ``message``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.time()
    out = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "-n", "2", "--", sys.executable, "-c",
                          script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode != 0
    assert time.time() - start < 60, out.stderr[-2000:]
    assert "[rank 1]" in out.stderr and message in out.stderr


@pytest.mark.skipif(MPIEXEC is None and shutil.which("mpirun") is None, reason="needs an MPI launcher")
def test_a_rank_that_raises_ends_the_job_within_60s():
    ends_within_60s(FAILING, "rank one fails on purpose")


STAGE_FAILS = """
import moe_infer
from comm import bootstrap
from moe_infer import ParallelConfig
from moe_infer.runner import PagedRunner
info = bootstrap(backend="gloo", timeout_s=600)  # longer than the test allows: the abort must end it
engine = moe_infer.load("tiny-moe", parallel=ParallelConfig(pp=2), progress=False, device="cpu")
stage, calls = PagedRunner.stage, [0]


def failing(self, rows, hidden):
    calls[0] += 1
    if info.rank == 1 and calls[0] == 4:  # the last stage, mid-generation
        raise RuntimeError("stage one fails on purpose")
    return stage(self, rows, hidden)


PagedRunner.stage = failing
engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=200)  # rank 0 waits for the stage after it
"""


@pytest.mark.skipif(MPIEXEC is None and shutil.which("mpirun") is None, reason="needs an MPI launcher")
def test_a_pipeline_stage_that_raises_ends_the_job_within_60s():
    ends_within_60s(STAGE_FAILS, "stage one fails on purpose")


MID_GRAPH = """
import moe_infer
from comm import bootstrap
from moe_infer import ParallelConfig
info = bootstrap(timeout_s=600)  # longer than the test allows: the abort must end it
engine = moe_infer.load("tiny-moe", parallel=ParallelConfig(tp=2), progress=False)
engine.generate([[1, 2, 3]], max_new_tokens=4)  # captures the decode steps, all-reduces inside
assert engine.decode_mode == "graph" and engine.runner._steps
if info.rank == 1:
    raise RuntimeError("rank one fails on purpose")
engine.generate([[1, 2, 3]], max_new_tokens=200)  # rank 0 replays graphs whose all-reduces wait for rank 1
"""


@pytest.mark.gpu
@pytest.mark.skipif(MPIEXEC is None and shutil.which("mpirun") is None, reason="needs an MPI launcher")
def test_a_rank_that_fails_while_its_peer_replays_a_graph_ends_the_job_within_60s():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ends_within_60s(MID_GRAPH, "rank one fails on purpose", timeout=120)


@pytest.mark.skipif(MPIEXEC is None and shutil.which("mpirun") is None, reason="needs an MPI launcher")
def test_ranks_may_use_every_core_the_launcher_may():
    """Open MPI binds each of a few ranks to one core unless told otherwise: rank 0's server,
    its HTTP workers and the threads beside it would then share that core."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # (one write a rank: print's pieces, unbuffered, can interleave with the other rank's)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "-n", "2", "--", sys.executable, "-c",
                          "import os; os.write(1, f'cores {len(os.sched_getaffinity(0))}\\n'.encode())"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("cores")] == \
        [f"cores {len(os.sched_getaffinity(0))}"] * 2
