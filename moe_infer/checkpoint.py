"""Reading weights from safetensors checkpoints (one file or a sharded set with its
index). Nothing is ever unpickled: ``.bin`` / ``.pt`` files are refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moe_infer.config import Config
from moe_infer.hf import Source, family_of, read_json, tensor_plan

_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, malformed or does not fit the config."""


def safetensors_files(directory: Path) -> dict[str, Path]:
    """Maps every tensor name in the checkpoint to the file that holds it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' ({exc})") from None
        files = {name: directory / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {index.name} but not found")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for pat in _PICKLES for p in directory.glob(pat)]
        if pickles:
            raise CheckpointError(
                f"{directory}: found {', '.join(sorted(pickles))} but no *.safetensors; moe-infer "
                f"reads safetensors only and never unpickles (convert the checkpoint with "
                f"transformers' save_pretrained(..., safe_serialization=True))")
        raise CheckpointError(f"{directory}: no *.safetensors file")
    files = {}
    for shard in shards:
        for name in _open(shard).keys():
            if name in files:
                raise CheckpointError(f"{shard}: tensor {name!r} also in {files[name]}")
            files[name] = shard
    return files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


class _Reader:
    """Keeps each shard open once while tensors are read."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.handles = files, {}

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = _open(path)
        try:
            t = self.handles[path].get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc}); is the file truncated?") from None
        if t.dtype not in _FLOAT:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        return t


def _assemble(src: Source, reader: _Reader) -> torch.Tensor:
    groups = [torch.cat([reader.get(n) for n in group], dim=0) for group in src.parts]
    return torch.stack(groups) if src.stacked else groups[0]


def load_checkpoint(model: torch.nn.Module, cfg: Config, directory: str | Path, progress: bool = True):
    """Fills every parameter of ``model`` from the checkpoint; all tensors must be used."""
    directory = Path(directory)
    files = safetensors_files(directory)
    family = family_of(read_json(directory / "config.json"), str(directory / "config.json"))
    params = dict(model.named_parameters())
    plan = tensor_plan(cfg, family, list(params))
    reader, used = _Reader(files), set()
    for ours, sources in tqdm(plan.items(), desc=f"loading {directory.name}", unit="tensor",
                              disable=not progress, leave=False):
        src = next((s for s in sources if all(n in files for n in s.names())), None)
        if src is None:
            missing = next(n for n in sources[0].names() if n not in files)
            raise CheckpointError(f"{directory}: missing tensor {missing!r} (needed for {ours})")
        used.update(src.names())
        module_name, param = ours.rsplit(".", 1)
        module = model.get_submodule(module_name)
        read = src
        if src.stacked and hasattr(module, "expert_range"):  # read only this rank's experts
            lo, hi = module.expert_range
            read = Source(src.parts[lo:hi], stacked=True)
        tensor = _assemble(read, reader)
        shard = getattr(module, "shard_fns", {}).get(param)
        if shard is not None and tensor.shape != params[ours].shape:
            tensor = shard(tensor)  # this rank's slice of a tensor- or expert-parallel weight
        target = params[ours]
        if tensor.shape != target.shape:
            raise CheckpointError(
                f"{files[src.names()[0]]}: tensors {src.describe()} give {ours} shape "
                f"{list(tensor.shape)}, expected {list(target.shape)} from config.json")
        with torch.no_grad():
            target.copy_(tensor)
    unexpected = sorted(set(files) - used)
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r} "
                              f"({len(unexpected)} unused in all) for a {family.name} model with this config")
