"""A CPU-only install runs the whole library: torch's CPU wheel brings neither Triton nor
CuPy, so ``moe_infer``, ``dense``, ``comm`` and ``kernels`` must not import them on a CPU
(the README's quick start on a fresh machine). Each check runs in a fresh Python process
whose ``sitecustomize`` makes ``import triton`` / ``import cupy`` fail as they do where
neither is installed, and records every attempt: the test process itself has Triton
imported (and TRITON_INTERPRET set by conftest), which the child must not inherit.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Shall I compare thee to a summer's day?"

# The child's sitecustomize: a meta-path finder in front of all others that refuses the GPU
# packages, and appends each refused name with the file whose import asked for it to the
# file CPU_ONLY_LOG names: an attempt that some code caught and ignored would not show in
# sys.modules. (torch probes for Triton itself, and copes without it.)
BLOCKER = '''
import importlib.abc
import os
import sys

GPU_PACKAGES = ("triton", "cupy", "cupy_backends", "cupyx")


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in GPU_PACKAGES:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):  # the import machinery
            frame = frame.f_back
        with open(os.environ["CPU_ONLY_LOG"], "a") as log:
            log.write(f"{name}\\t{frame.f_code.co_filename if frame else '?'}\\n")
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NotInstalled())
'''

# Run in the child: the blocker is active, then every CPU path of the engine.
ENGINE_PATHS = f'''
import sys

try:
    import triton  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the import blocker is not active")

import torch
import moe_infer

engine = moe_infer.load(progress=False)
out = engine.generate({PROMPT!r}, max_new_tokens=8)[0]
assert out.text and 1 <= len(out.token_ids) <= 8, out
logits = engine.logits([[1, 2, 3], [4, 5]])
assert logits.shape[:2] == (2, 3) and torch.isfinite(logits).all()

tiny = moe_infer.load("tiny-moe", quantize="int8", progress=False)
assert any(p.dtype == torch.int8 for p in tiny.model.parameters()), "no int8 weights"
outs = tiny.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
assert [len(o.token_ids) for o in outs] == [4, 4], outs

gpu = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "cupy"))
assert not gpu, gpu
print("engine paths ok")
'''

# Run in the child after the engine paths: a GPU backend is imported where a GPU path
# first needs it, and without Triton that import fails by name, not silently.
GPU_NAME_FAILS = '''
import kernels

try:
    from kernels.routing.gating import topk_gating_triton  # noqa: F401
except ModuleNotFoundError as e:
    assert e.name == "triton", e
    print("backend import fails by name")
else:
    raise AssertionError("kernels.routing.gating imported without Triton")
'''

# Run in a child that has Triton: importing kernels loads no backend; importing every
# backend module later leaves each package's ops in place (the package kernels/argmax/ and
# the op kernels.argmax share a name, and so would a backend module named as its op).
LATE_BACKENDS = '''
import importlib
import pkgutil
import sys
import types

import kernels

assert "triton" not in sys.modules, "importing kernels imported triton"
ops = {"kernels": kernels.__all__}
for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
    module = importlib.import_module(info.name)
    assert module.__name__ == info.name
    if info.ispkg:
        ops[info.name] = module.__all__
assert "triton" in sys.modules and "kernels.argmax.triton" in sys.modules and "kernels.routing.route_triton" in sys.modules
for package, names in ops.items():
    for op in names:
        value = getattr(sys.modules[package], op)
        assert isinstance(value, types.FunctionType), f"{package}.{op} is now {value!r}"
assert kernels.argmax is sys.modules["kernels.argmax"].argmax
print("late backends ok")
'''

SERVER = f'''
import sys

from fastapi.testclient import TestClient

import moe_infer
from moe_infer.server import ServerConfig, create_app

engine = moe_infer.load(progress=False)
want = engine.generate([{PROMPT!r}], max_new_tokens=8)[0].text
with TestClient(create_app(engine, ServerConfig(block_size=8))) as client:
    r = client.post("/v1/completions", json={{"prompt": {PROMPT!r}, "max_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want, (r.json(), want)
gpu = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "cupy"))
assert not gpu, gpu
print("server ok")
'''


def run_cpu_only(tmp_path: Path, cmd: list[str], timeout: int = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    """cmd (its first word a program) without Triton and CuPy, no GPU visible, from the
    repository root -> (the finished process, "name from file" for each GPU package that a
    file of this repository tried to import)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    log = tmp_path / "gpu_imports.log"
    log.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), CPU_ONLY_LOG=str(log), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    attempts = [line.split("\t") for line in log.read_text().splitlines()]
    return out, [f"{name} from {Path(file).relative_to(ROOT)}" for name, file in attempts
                 if Path(file).is_relative_to(ROOT)]


def test_engine_runs_without_triton_or_cupy(tmp_path):
    out, attempts = run_cpu_only(tmp_path, [sys.executable, "-c", ENGINE_PATHS])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "engine paths ok" in out.stdout
    assert attempts == [], f"tried to import {attempts} on a CPU"


def test_gpu_backend_without_triton_fails_by_name(tmp_path):
    out, attempts = run_cpu_only(tmp_path, [sys.executable, "-c", GPU_NAME_FAILS])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend import fails by name" in out.stdout
    assert attempts == ["triton from kernels/routing/gating.py"]


def test_gpu_backends_load_at_first_use_and_keep_the_ops_names():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", LATE_BACKENDS], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "late backends ok" in out.stdout


def test_cli_generate_without_triton_or_cupy(tmp_path):
    out, attempts = run_cpu_only(tmp_path, [sys.executable, "-m", "moe_infer", "generate", "--prompt", PROMPT,
                                            "--max-new-tokens", "8"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(PROMPT) and len(out.stdout.strip()) > len(PROMPT), out.stdout
    assert attempts == [], f"tried to import {attempts} on a CPU"


def test_server_without_triton_or_cupy(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")  # fastapi's TestClient
    out, attempts = run_cpu_only(tmp_path, [sys.executable, "-c", SERVER])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "server ok" in out.stdout
    assert attempts == [], f"tried to import {attempts} on a CPU"


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the test extras install mpich)")
def test_two_gloo_ranks_without_triton_or_cupy(tmp_path):
    """Tensor and expert parallelism over gloo: the dense layers' and the dispatcher's
    collectives, and the expert-parallel rows' tags."""
    out, attempts = run_cpu_only(tmp_path, ["bash", str(ROOT / "scripts" / "launch.sh"), "-n", "2", "--",
                                            sys.executable, "-m", "moe_infer", "generate", "--tp", "2", "--ep", "2",
                                            "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(PROMPT) and len(out.stdout.strip()) > len(PROMPT), out.stdout
    assert attempts == [], f"tried to import {attempts} on a CPU"
