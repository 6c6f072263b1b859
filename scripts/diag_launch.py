"""Host-side cost per call of our kernel wrappers (diagnostic)."""
import time, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch, triton, triton.language as tl
import kernels
from kernels.maps import token_maps_triton
from kernels.layout import scatter_rows_triton, gather_rows_triton, combine_rows_triton


@triton.jit
def _noop(x_ptr, n):
    pass


@triton.jit
def _noop_many(a, b, c, d, e, f, g, h, n1, n2, n3, n4, n5, n6, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
               D: tl.constexpr, E: tl.constexpr, F: tl.constexpr, G: tl.constexpr):
    pass


def host_us(fn, n=300):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t) / n * 1e6


x = torch.randn(16, device="cuda")
ts = [torch.randn(16, device="cuda") for _ in range(8)]
ck = _noop.warmup(x, 5, grid=(1,))
print(f"noop 2 args            {host_us(lambda: _noop[(1,)](x, 5)):7.1f} us")
print(f"noop compiled direct   {host_us(lambda: ck[(1, 1, 1)](x, 5)):7.1f} us")
print(f"noop 14 args 7 constexpr {host_us(lambda: _noop_many[(1,)](*ts, 1, 2, 3, 4, 5, 6, A=1, B=2, C=3, D=4, E=5, F=6, G=7)):7.1f} us")
print(f"torch.empty            {host_us(lambda: torch.empty(16, 4096, device='cuda')):7.1f} us")
print(f"torch.zeros            {host_us(lambda: torch.zeros(16, 4096, device='cuda')):7.1f} us")
t, e, k, h = 1, 8, 2, 4096
logits = torch.randn(t, e, device="cuda")
xx = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
ids, w = kernels.topk_gating(logits, k)
offs, rows, rp = token_maps_triton(ids, e)
xs = scatter_rows_triton(xx, rows)
print(f"topk_gating            {host_us(lambda: kernels.topk_gating(logits, k)):7.1f} us")
print(f"token_maps_triton      {host_us(lambda: token_maps_triton(ids, e)):7.1f} us")
print(f"scatter_rows_triton    {host_us(lambda: scatter_rows_triton(xx, rows)):7.1f} us")
print(f"gather_rows_triton     {host_us(lambda: gather_rows_triton(xs, rows, w)):7.1f} us")
w13 = torch.randn(e, 2 * 64, h, device="cuda", dtype=torch.bfloat16)
w2 = torch.randn(e, h, 64, device="cuda", dtype=torch.bfloat16)
print(f"fused_moe small        {host_us(lambda: kernels.fused_moe(xx, w13, w2, w, ids)):7.1f} us")
import cProfile, pstats
cProfile.run("for _ in range(200): kernels.fused_moe(xx, w13, w2, w, ids)", "/tmp/p")
pstats.Stats("/tmp/p").sort_stats("tottime").print_stats(14)
