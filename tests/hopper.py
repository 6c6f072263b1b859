"""Runs a Triton compile for sm_90 (front end and ptxas, no GPU needed) in a process of its
own, without the interpreter: it checks what the interpreter lets through (globals,
constexpr and type rules, the PDL calls)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def compile_in_subprocess(code: str, *args) -> str:
    """Runs ``code`` (which compiles a kernel and prints its cubin size last) with ``args``
    in a fresh interpreter-free Python; -> its stdout. Fails the test with the compiler's
    messages where the compile fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
