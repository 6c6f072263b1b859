"""``moe_infer.load``: a checkpoint directory, a YAML config or a built-in name -> Engine."""
from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from comm import ParallelGroups, bootstrap

from moe_infer.checkpoint import load_checkpoint
from moe_infer.config import Config, ConfigError, ParallelConfig
from moe_infer.config_files import load_preset, load_yaml_config, preset_names
from moe_infer.engine import Engine
from moe_infer.memory import check_fits, check_offload_fits
from moe_infer.hf import read_hf_config, read_json
from moe_infer.model import Transformer, init_random
from moe_infer.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_config(path_or_name: str | Path | Config | None) -> Config:
    """None or "default": the embedded model; a directory: a Hugging Face checkpoint;
    a .yaml/.yml file: a YAML config; a ``Config``: itself; otherwise a built-in preset name."""
    if isinstance(path_or_name, Config):  # a copy: an engine's settings change on it
        return copy.deepcopy(path_or_name)
    if path_or_name is None:
        return load_preset("default")
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        return read_hf_config(path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"{path}: YAML config not found")
        return load_yaml_config(path)
    if str(path_or_name) in preset_names():  # (names such as qwen1.5-moe-a2.7b end in what looks like a suffix)
        return load_preset(str(path_or_name))
    if "/" in str(path_or_name) or path.suffix:
        raise ConfigError(f"{path_or_name}: not a checkpoint directory or a .yaml file")
    if str(path_or_name) not in preset_names():
        raise ConfigError(f"{path_or_name!r}: not a checkpoint directory, a .yaml file or a built-in "
                          f"name (built-in: {', '.join(preset_names())})")
    return load_preset(str(path_or_name))


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={str(device)!r}: CUDA is not available on this machine")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype={dtype}: expected one of {', '.join(_DTYPES)}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype={dtype!r}: expected auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _parallel_groups(p: ParallelConfig):
    """Groups for the layout; a multi-rank layout starts torch.distributed from the MPI job
    (once per process) and must match its size."""
    if p.world_size == 1:  # (the config checks that ep * expert_slicing divides it)
        return ParallelGroups.single(), None
    if not dist.is_initialized():
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() != p.world_size:
            raise ConfigError(f"parallel: tp={p.tp} * dp={p.dp} * pp={p.pp} needs {p.world_size} ranks, "
                              f"but this job has {MPI.COMM_WORLD.Get_size()}; launch with mpirun -n "
                              f"{p.world_size} (scripts/launch.sh)")
        bootstrap(timeout_s=p.timeout_s)
    if dist.get_world_size() != p.world_size:
        raise ConfigError(f"parallel: tp={p.tp} * dp={p.dp} * pp={p.pp} = {p.world_size} ranks, "
                          f"but torch.distributed has {dist.get_world_size()}")
    rank = dist.get_rank()
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else None
    return ParallelGroups.build(p, rank, p.world_size), device


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype, on_host: tuple[nn.Module, ...] = (),
                 host_dir: str | None = None):
    """Replaces meta parameters with uninitialised ones on the device, without a copy; those
    of the modules ``on_host`` in host memory: pinned for a GPU, or with ``host_dir``
    memory-mapped from one file each there (the loader's writes go to the files)."""
    host_params = {id(p) for m in on_host for p in m.parameters()}
    if host_params and host_dir is not None:
        Path(host_dir).mkdir(parents=True, exist_ok=True)
    for path, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            kind = dtype if p.is_floating_point() else p.dtype  # (MXFP4 codes and scales stay bytes)
            if id(p) in host_params and host_dir is not None:
                file = Path(host_dir) / f"{path}.{name}.bin"
                with open(file, "wb") as f:
                    f.truncate(p.numel() * kind.itemsize)
                t = torch.from_file(str(file), shared=True, size=p.numel(), dtype=kind).view(p.shape)
            else:
                host = id(p) in host_params
                t = torch.empty(p.shape, device="cpu" if host else device, dtype=kind,
                                pin_memory=host and device.type == "cuda")
            module._parameters[name] = nn.Parameter(t, requires_grad=False)


def _mxfp4_checkpoint(directory: str | Path) -> bool:
    """Whether a checkpoint's experts are stored in MXFP4 (GPT-OSS's release format)."""
    quant = read_json(Path(directory) / "config.json").get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def load(path_or_name: str | Path | None = None, *, device: str | torch.device | None = None,
         dtype: str | torch.dtype | None = None, parallel: ParallelConfig | str | None = None,
         checkpoint: str | Path | None = None, progress: bool = True, quantize: str | None = None,
         gpu_memory_gb: float | None = None, offload: str | None = None, offload_dir: str | None = None,
         hardware: str | None = None, kv_offload: str | None = None) -> Engine:
    """Builds an inference engine. See ``resolve_config`` for what ``path_or_name`` may be;
    ``checkpoint`` takes the model and weights from a Hugging Face directory instead, keeping
    the engine and parallel settings of ``path_or_name`` when that is given too. ``parallel``
    "auto" (or ``parallel: auto`` in the YAML): the cost model picks the layout of the
    job's ranks (``engine.hardware``: its profile)."""
    if checkpoint is not None:
        base = read_hf_config(checkpoint)
        if path_or_name is not None:
            given = resolve_config(path_or_name)
            base = dataclasses.replace(base, engine=given.engine, parallel=given.parallel,
                                       parallel_auto=given.parallel_auto)
        cfg = base
    else:
        cfg = resolve_config(path_or_name)
    # EngineConfig fields applied at load: quantize (int8, or MXFP4 experts), the device's
    # weight budget and how offloaded experts run (``moe_infer.offload``), the cost model's
    # hardware profile (``parallel: auto``), the KV cache in host memory (``kv_offload``).
    given = {k: v for k, v in (("quantize", quantize), ("gpu_memory_gb", gpu_memory_gb), ("offload", offload),
                               ("offload_dir", offload_dir), ("hardware", hardware), ("kv_offload", kv_offload))
             if v is not None}
    if given:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, **given))
    auto_note = None
    if isinstance(parallel, str) and parallel != "auto":
        raise ConfigError(f"parallel={parallel!r}: expected a ParallelConfig, None or 'auto'")
    if parallel == "auto" or (parallel is None and cfg.parallel_auto):
        # The layout of the job's ranks, by the cost model (the same choice on every rank).
        from moe_infer.costmodel import choose_layout, weight_sizes
        from moe_infer.job import launched_ranks

        chosen, auto_note = choose_layout(cfg, launched_ranks(), cfg.engine.hardware,
                                          **weight_sizes(cfg.engine.quantize))
        keep = {k: getattr(cfg.parallel, k) for k in ("timeout_s", "all_reduce", "a2a_fixed_tokens")}
        parallel = dataclasses.replace(chosen, **keep)
    if parallel is not None:
        cfg = dataclasses.replace(cfg, parallel=parallel)  # re-validates against the model
    groups, rank_device = _parallel_groups(cfg.parallel)
    multi = dist.is_initialized() and dist.get_world_size() > 1
    progress = progress and (not multi or dist.get_rank() == 0)  # one progress bar per job
    dev = resolve_device(device if device is not None else (rank_device or cfg.engine.device))
    dt = resolve_dtype(dtype if dtype is not None else cfg.engine.dtype, dev)
    with torch.device("meta"):
        model = Transformer(cfg, groups)
    if cfg.engine.quantize == "mxfp4" and (cfg.checkpoint is None or _mxfp4_checkpoint(cfg.checkpoint)):
        # Random codes, or an MXFP4 checkpoint's codes read as they are: the experts never
        # exist in full precision (a model whose bf16 experts exceed the host loads too).
        from moe_infer.experts import pack_experts

        pack_experts(model)
    # Models larger than the device (``moe_infer.offload``): the routed experts, or with
    # offload "layers" every block, loaded into host memory.
    offload = cfg.engine.gpu_memory_gb is not None
    streamed = cfg.engine.offload == "layers"
    on_host: tuple = ()
    if offload:
        from moe_infer.experts import Experts

        on_host = tuple(m for m in model.modules() if isinstance(m, Experts))
    elif streamed:
        on_host = tuple(model.layers)
    # Before anything is allocated: ranks on a CPU host share its memory.
    staged = False
    if on_host:
        check_offload_fits(cfg, dt, dev, model)
    else:
        staged = check_fits(cfg, dt, dev, model, dist.get_world_size() if multi and dev.type == "cpu" else 1)
    # Quantized weights whose full-precision ones do not fit on the GPU: load them into host
    # memory and quantize onto the GPU one module at a time.
    _materialize(model, torch.device("cpu") if staged else dev, dt, on_host, cfg.engine.offload_dir)
    if streamed:  # where the blocks run: random values are drawn there, as for the all-GPU model
        model.home = dev
    prepare = None
    if cfg.checkpoint is not None:
        load_checkpoint(model, cfg, cfg.checkpoint, progress=progress)
    elif staged:  # random values drawn on the GPU, each module as it arrives there
        generator = torch.Generator(device=dev).manual_seed(cfg.engine.seed)
        prepare = functools.partial(init_random, generator=generator)
    else:
        model.init_random(cfg.engine.seed)
    # Layers whose GEMMs merge once their weights are in (before quantizing, which int8
    # does to both alike): latent attention's two input projections (and its up projection
    # with the rotary key's gap, which is never quantized); an MoE layer's shared
    # experts as experts of its routed call, where the config allows (``Config.folds_shared``).
    from dense.mla import LatentAttention
    from moe_infer.moe_layer import MoELayer

    fold = cfg.folds_shared()
    for layer in model.modules():
        if isinstance(layer, LatentAttention):
            layer.merge_projections()
            layer.gap_up_projection()
        elif isinstance(layer, MoELayer) and fold:
            layer.fold_shared()
    if cfg.engine.quantize is not None:  # bf16 / fp32 weights in, int8 (or MXFP4 experts) on the device
        from moe_infer.experts import quantize_experts, quantize_model

        if cfg.engine.quantize == "int8":
            quantize_model(model, dev if staged else None, prepare)
        else:
            quantize_experts(model, dev if staged else None, prepare, kind=cfg.engine.quantize)
            if staged:
                model.to(dev)
        if prepare is not None:
            init_random(model, generator)  # what stayed in full precision (norms, embeddings, routers)
    if offload:
        from moe_infer import offload as off

        off.offload_experts(model, cfg, dev, dt)
    elif streamed:
        from moe_infer.layer_streamer import LayerStreamer

        # Replicas that hold the same weights (every expert within a TP group) share each
        # block's copy: each fetches a part, an all-gather joins them (they step together).
        p = cfg.parallel
        same = groups.dp if p.tp % (p.ep * p.expert_slicing) == 0 else None
        LayerStreamer(model.layers, dev, cfg.engine.prefetch_layers, same)
    model.eval()
    tokenizer = None
    if cfg.checkpoint is not None and (Path(cfg.checkpoint) / "tokenizer.json").is_file():
        tokenizer = Tokenizer(Path(cfg.checkpoint) / "tokenizer.json")
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"{tokenizer.path}: {tokenizer.vocab_size} tokens, more than the "
                              f"model's vocab_size={cfg.model.vocab_size}")
    engine = Engine(model, cfg, tokenizer, groups)
    engine.auto_layout = auto_note  # parallel: auto: what was chosen (None otherwise)
    return engine
