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


# What every kernel's compile check runs after its setup: the signature (the setup's
# ``types``; strides int64, other pointers bf16), the compile for sm_90, the cubin's size.
_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert {{p.name for p in kernel.params if p.is_constexpr}} == set(const)  # none compiled as a pointer
sig = {{n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "*bf16")
       for n in kernel.arg_names}}
compiled = triton.compile(ASTSource(kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps={warps}))
print("cubin bytes", len(compiled.asm["cubin"]))
"""


def compile_kernel(setup: str, *args, warps: int = 4) -> int:
    """Compiles the Triton kernel that ``setup`` binds to ``kernel``, with the constexprs
    ``const`` and the argument types ``types`` (it may read ``args`` from sys.argv), for
    sm_90 with ``warps`` warps in a fresh process (``compile_in_subprocess``) -> the cubin's
    bytes."""
    return int(compile_in_subprocess(setup + _COMPILE.format(warps=warps), *args).split()[-1])
