"""What a model needs in memory per rank, what the device has, and what would make it fit.

The weights are counted on a ``meta`` copy of the model as each rank builds it (the same
modules, so tensor- and expert-parallel slicing, shared experts and tied embeddings are
counted exactly, and nothing is allocated); int8 counts one byte per quantized weight plus
its float32 scales. The KV cache is counted for one sequence of ``max_seq_len`` tokens,
the least a model must hold to serve its context.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from comm import Group, ParallelGroups
from moe_infer.config import Config, ConfigError, ParallelConfig

GB = 1e9


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts of the whole model (all ranks together)."""

    total: int
    active: int  # used per token: everything but the routed experts not picked (top_k of E)

    def bf16_bytes(self) -> int:
        return 2 * self.total


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one rank holds: its weights and its KV cache."""

    weights: int
    kv_per_token: int
    tokens: int  # the KV cache counted: one sequence of max_seq_len
    staging: int = 0  # int8 loaded through host memory: the largest module in full precision

    @property
    def kv(self) -> int:
        return self.kv_per_token * self.tokens

    @property
    def total(self) -> int:
        return self.weights + self.kv


def _fake_groups(parallel: ParallelConfig) -> ParallelGroups:
    """Rank 0's groups for a layout, without torch.distributed: enough to build the meta
    model, which only reads group sizes and ranks."""
    def group(n: int) -> Group:
        return Group(None, 0, n, tuple(range(n)))

    experts = parallel.ep * parallel.expert_slicing
    return ParallelGroups(group(parallel.tp), group(parallel.dp), group(experts), group(parallel.expert_slicing),
                          group(parallel.dp), pp=group(parallel.pp))  # the first stage's blocks


def meta_model(cfg: Config):
    """The model as rank 0 of ``cfg.parallel`` builds it, on the meta device."""
    from moe_infer.model import Transformer

    with torch.device("meta"):
        return Transformer(cfg, _fake_groups(cfg.parallel))


def model_size(cfg: Config) -> ModelSize:
    """Total and active parameters of the model on one rank (no parallelism)."""
    from moe_infer.experts import expert_targets

    single = Config(cfg.model, cfg.moe, ParallelConfig(), cfg.engine, cfg.name, cfg.checkpoint)
    model = meta_model(single)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(getattr(parent, name).w13.numel() + getattr(parent, name).w2.numel()
                 for parent, name in expert_targets(model))
    active = total - routed + (routed * cfg.moe.top_k // cfg.moe.num_experts if cfg.moe else 0)
    return ModelSize(total, active)


def memory_need(cfg: Config, dtype: torch.dtype, model=None, int8: bool | None = None) -> MemoryNeed:
    """Bytes a rank needs for weights of ``dtype`` and the KV cache of one ``max_seq_len``
    sequence: the rank that built ``model`` (only its shapes are read; by default rank 0 of
    ``cfg.parallel``, on the meta device). ``int8`` defaults to ``cfg.engine.quantize``."""
    from dense.quant import linear_targets
    from moe_infer.experts import expert_targets

    kind = cfg.engine.quantize if int8 is None else ("int8" if int8 else None)
    model = model if model is not None else meta_model(cfg)
    size = dtype.itemsize
    stored = {}  # id(parameter) -> bytes when int8 / MXFP4 replaces it
    staging = 0
    if kind is not None:
        for parent, name in expert_targets(model):
            experts = getattr(parent, name)
            for w in (experts.w13, experts.w2):
                # int8 and float32 scales; MXFP4: half a byte a weight and a byte per 32
                stored[id(w)] = (w.numel() + 4 * w.shape[0] * w.shape[1] if kind == "int8"
                                 else w.numel() // 2 + w.numel() // 32)
            staging = max(staging, (experts.w13.numel() + experts.w2.numel()) * size)
    if kind == "int8":
        for parent, name in linear_targets(model):
            w = getattr(parent, name).weight
            stored[id(w)] = w.numel() + 4 * w.shape[0]
            staging = max(staging, w.numel() * size)
    weights = sum(stored.get(id(p), p.numel() * (size if p.is_floating_point() else p.element_size()))
                  for p in model.parameters())
    m = cfg.model
    # (an offloaded KV cache: two layers' pools on the device, whatever the model's depth, and
    # with "alternate" the other half of the layers)
    layers = {None: m.num_layers, "all": min(2, m.num_layers),
              "alternate": m.num_layers // 2 + min(2, (m.num_layers + 1) // 2)}[cfg.engine.kv_offload]
    # (split by tokens: every KV head of 1 / tp of the tokens)
    heads = model.num_kv_heads
    if cfg.parallel.kv_shard == "tokens":
        heads = (1 if m.kv_lora_rank is not None else m.num_kv_heads) / cfg.parallel.tp
    kv_per_token = int(layers * heads * sum(m.kv_widths) * size)
    return MemoryNeed(weights, kv_per_token, cfg.max_seq_len, staging)


def available_bytes(device: torch.device) -> int:
    """Free memory of a GPU, or the host memory the kernel reports available."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _spread(cfg: Config, ranks: int) -> Config | None:
    """``cfg`` on ``ranks`` ranks, split as far as it goes: every rank tensor-parallel and
    the experts spread over all of them (None where the model does not split so)."""
    m, e = cfg.model, cfg.moe
    tp = ranks if m.num_heads % ranks == 0 and (m.num_kv_heads % ranks == 0 or ranks % m.num_kv_heads == 0) else 1
    ep = ranks if e is not None and e.num_experts % ranks == 0 else 1
    if tp == 1 and ep == 1:
        return None
    try:
        layout = ParallelConfig(tp=tp, dp=ranks // tp, ep=ep, pcc=cfg.parallel.pcc)
        return Config(cfg.model, cfg.moe, layout, cfg.engine, cfg.name, cfg.checkpoint)
    except ConfigError:
        return None


def check_offload_fits(cfg: Config, dtype: torch.dtype, device: torch.device, model) -> None:
    """Raises ``ConfigError`` unless what an offloaded model keeps on the device and one
    full-length sequence's KV cache fit in its free memory: ``engine.gpu_memory_gb`` of
    weights and, where calls stream experts in, their staging area; or with offload
    "layers" everything but the blocks and ``prefetch_layers`` + 1 of the largest block (the
    rest lives in host memory)."""
    e = cfg.engine
    kv = memory_need(cfg, dtype, model, int8=False).kv
    have = available_bytes(device)
    if e.offload == "layers":
        size = dtype.itemsize
        blocks = [sum(p.numel() for p in b.parameters()) * size for b in model.layers]
        rest = sum(p.numel() for p in model.parameters()) * size - sum(blocks)
        need = rest + (e.prefetch_layers + 1) * max(blocks) + kv
        if need > have:
            raise ConfigError(f"engine.prefetch_layers={e.prefetch_layers}: streaming layers needs {need / GB:.2f} GB "
                              f"on {device} (embeddings and head {rest / GB:.2f}, {e.prefetch_layers + 1} blocks of "
                              f"{max(blocks) / GB:.2f}, one sequence's KV {kv / GB:.2f}), but it has "
                              f"{have / GB:.2f} GB free")
        return
    budget = e.gpu_memory_gb * GB
    staging = 0
    if e.offload != "cpu":  # streamed calls copy cold experts into one staging area the layers share
        from moe_infer.offload import staging_bytes

        staging = staging_bytes(model, dtype)
    if budget + kv + staging > have:
        raise ConfigError(f"engine.gpu_memory_gb={e.gpu_memory_gb:g}: with one sequence's KV cache "
                          f"({kv / GB:.2f} GB) and the staging area for streamed experts ({staging / GB:.2f} GB) it "
                          f"needs {(budget + kv + staging) / GB:.2f} GB, but {device} has {have / GB:.2f} GB free; "
                          f"expected at most {(have - kv - staging) / GB:.2f}")


def check_fits(cfg: Config, dtype: torch.dtype, device: torch.device, model, ranks_here: int = 1) -> bool:
    """Raises ``ConfigError`` (one line: needed, available, what would fit) unless the
    weights of ``model`` (this rank's, on the meta device) and one full-length sequence's KV
    cache fit in the device's free memory; ``ranks_here`` ranks share it (CPU ranks share
    the host's memory).

    Returns whether a quantized model must be staged: loaded in full precision into host
    memory and quantized onto the GPU module by module, because its full-precision
    weights do not fit on the GPU (they are what the direct path loads first)."""
    have = available_bytes(device)
    full = memory_need(cfg, dtype, model, int8=False)
    if full.total * ranks_here <= have:
        return False
    if cfg.engine.quantize is not None and device.type == "cuda":
        need = memory_need(cfg, dtype, model)
        host = available_bytes(torch.device("cpu"))
        if need.total + need.staging <= have and full.weights * ranks_here <= host:
            return True
        if full.weights * ranks_here > host:
            raise ConfigError(f"{cfg.name}: {cfg.engine.quantize} weights {need.weights / GB:.1f} GB fit on {device}, "
                              f"but they are loaded in full precision first ({full.weights / GB:.1f} GB per rank) "
                              f"and the host has {host / GB:.1f} GB available")
    else:
        need = full
    where = f"{device}" + (f", shared by {ranks_here} ranks" if ranks_here > 1 else "")
    per_rank = " per rank" if cfg.parallel.world_size > 1 else ""
    hints = []
    if cfg.engine.quantize != "int8":
        q = memory_need(cfg, dtype, model, int8=True)
        if q.total * ranks_here <= have and (device.type == "cuda" or ranks_here == 1):
            hints.append(f"--quantize int8 ({q.total / GB:.1f} GB{per_rank})")
    for ranks in (2, 4, 8, 16, 32, 64) if device.type == "cuda" else ():  # CPU ranks share one host
        spread = _spread(cfg, ranks) if ranks > cfg.parallel.world_size else None
        if spread is None:
            continue
        layout = spread.parallel
        n = memory_need(spread, dtype).total
        if n <= have:
            flags = f"--tp {layout.tp}" + (f" --ep {layout.ep}" if layout.ep > 1 else "")
            hints.append(f"{ranks} ranks of one device each (scripts/launch.sh -n {ranks} -- moe-infer ... "
                         f"{flags}: {n / GB:.1f} GB per rank)")
            break
    if need.kv > need.weights // 4:
        hints.append(f"a shorter engine.max_seq_len (KV cache {need.kv_per_token * 1024 / GB:.2f} GB per 1024 "
                     f"tokens)")
    advice = "; it would fit with " + ", or ".join(hints) if hints else ""
    kind = str(dtype).removeprefix("torch.") + {"int8": " + int8", "mxfp4": " + MXFP4 experts"}.get(
        cfg.engine.quantize, "")
    raise ConfigError(
        f"{cfg.name} needs {need.total * ranks_here / GB:.1f} GB{per_rank} ({kind}: weights {need.weights / GB:.1f} "
        f"GB + KV cache {need.kv / GB:.1f} GB for one {need.tokens}-token sequence), but {where} has "
        f"{have / GB:.1f} GB available{advice}")
