"""The benchmark scripts run end to end in their smoke modes (tiny shapes on the CPU), so a
GPU session's scarce device time is not lost to a script that no longer starts. Their
numbers here mean nothing; only that each prints its table and exits 0."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMOKES = {
    "bench_moe": (["--smoke", "--no-json"], "routing-graph"),
    "bench_dense": (["--device", "cpu", "--smoke"], "SDPA masked"),
    "bench_decode": (["--device", "cpu", "--smoke"], "floor MB"),
    "bench_serve": (["--smoke"], "TTFT p50"),
}


@pytest.mark.parametrize("script", list(SMOKES))
def test_benchmark_smoke_run(script):
    args, header = SMOKES[script]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert header in out.stdout, out.stdout[-2000:]
