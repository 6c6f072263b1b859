import torch, kernels, importlib, sys
g = importlib.import_module("kernels.gating")
sys.path.insert(0, "scripts")
import bench_common as bc
torch.manual_seed(0)
dev = torch.device("cuda")
w13b = torch.randn(128, 1536, 2048, device=dev).to(torch.bfloat16)
w2b = torch.randn(128, 2048, 768, device=dev).to(torch.bfloat16)
q13, s13 = kernels.quantize_int8(w13b)
q2, s2 = kernels.quantize_int8(w2b)
sets = [(torch.randn(1, 2048, device=dev).to(torch.bfloat16), torch.randn(1, 128, device=dev).to(torch.bfloat16)) for _ in range(16)]
def layer(w13, w2, sc, mb):
    def fn():
        for x, lg in sets:
            ids, wts = kernels.topk_gating(lg, 8, "softmax", True, w13, mb << 20)
            kernels.fused_moe(x, w13, w2, wts, ids, "silu", *sc)
    return fn
for mode, blks in ((3, (256,)), (1, (64, 256, 1024)), (2, (256,))):
    g.PF_MODE = mode
    for blk in blks:
        g.PF_BLOCK = blk
        for name, w13 in (("bf16", w13b), ("int8", q13)):
            row = []
            for mb in (0, 2, 8):
                fn = lambda: [kernels.topk_gating(sets[0][1], 8, "softmax", True, w13, mb << 20) for _ in range(16)]
                us = bc.time_graph(fn, reps=30, device=dev) / 16
                row.append(f"{mb}MB {us:6.2f}")
            print(f"gating alone {name} mode {mode} block {blk}: " + " ".join(row), flush=True)
        if mode == 3:
            continue
        for name, w13, w2, sc in (("bf16", w13b, w2b, ()), ("int8", q13, q2, (s13, s2))):
            row = []
            for mb in (0, 1, 2, 4, 8):
                us = bc.time_graph(layer(w13, w2, sc, mb), reps=30, device=dev) / 16
                row.append(f"{mb}MB {us:6.2f}")
            print(f"gating+moe {name} mode {mode} block {blk}: " + " ".join(row), flush=True)
