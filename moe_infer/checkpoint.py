"""Reading weights from safetensors checkpoints (one file or a sharded set with its
index). Nothing is ever unpickled: ``.bin`` / ``.pt`` files are refused by name.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moe_infer.config import Config
from moe_infer.hf import Source, family_of, read_json, tensor_plan

log = logging.getLogger(__name__)

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


_SAFE_FLOAT = {"F32", "F16", "BF16"}


class _Reader:
    """Keeps each shard open once while tensors are read; reads whole tensors or row /
    column ranges of them (safetensors slices: only those bytes leave the file).

    ``fp8_block`` (rows, columns): the checkpoint stores float8 e4m3 weights with one
    float32 ``<name>_scale_inv`` per block of that size (DeepSeek-V3's, Kimi K2's, the
    FP8 releases of GLM-4.5 and Qwen3): such a weight reads as float32, w * scale_inv."""

    def __init__(self, files: dict[str, Path], fp8_block: tuple[int, int] | None = None):
        self.files, self.handles, self.fp8_block = files, {}, fp8_block

    def slice(self, name: str, kinds: set[str] = _SAFE_FLOAT):
        path = self.files[name]
        if path not in self.handles:
            self.handles[path] = _open(path)
        try:
            view = self.handles[path].get_slice(name)
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc}); is the file truncated?") from None
        fp8 = view.get_dtype() == "F8_E4M3" and self.fp8_block is not None and name + "_scale_inv" in self.files
        if view.get_dtype() not in kinds and not (fp8 and kinds is _SAFE_FLOAT):
            what = "a float type" if kinds is _SAFE_FLOAT else " or ".join(sorted(kinds))
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {view.get_dtype()}, expected {what}")
        return view

    def _fp8(self, name: str, view) -> torch.Tensor:
        w = view[:]
        scale = self.slice(name + "_scale_inv")[:]
        rows, cols = w.shape
        br, bc = self.fp8_block
        if tuple(scale.shape) != (-(-rows // br), -(-cols // bc)):
            raise CheckpointError(f"{self.files[name]}: tensor {name + '_scale_inv'!r} has shape {list(scale.shape)}, "
                                  f"expected {[-(-rows // br), -(-cols // bc)]}: one scale per {br} x {bc} block")
        return dequantize_fp8(w, scale, self.fp8_block)

    def shape(self, name: str, expected: tuple[int, ...], kinds: set[str] = _SAFE_FLOAT) -> list[int]:
        """The tensor's shape from its header, which must be ``expected``."""
        found, want = list(self.slice(name, kinds).get_shape()), list(expected)
        if found != want:
            hint = " (transposed?)" if len(want) == 2 and found == want[::-1] else ""
            raise CheckpointError(f"{self.files[name]}: tensor {name!r} has shape {found}, expected "
                                  f"{want} from config.json{hint}")
        return found

    def get(self, name: str, index: tuple = (), kinds: set[str] = _SAFE_FLOAT) -> torch.Tensor:
        view = self.slice(name, kinds)
        if view.get_dtype() == "F8_E4M3" and kinds is _SAFE_FLOAT:  # block-scaled float8: dequantized whole
            w = self._fp8(name, view)
            return w[index] if index else w
        try:
            return view[index] if index else view[:]
        except Exception as exc:
            raise CheckpointError(f"{self.files[name]}: cannot read tensor {name!r} ({exc}); "
                                  f"is the file truncated?") from None


class _Lazy:
    """A checkpoint Source seen as one tensor without reading it: ``shape`` comes from the
    headers and indexing with slices reads only the rows / columns asked for. Sharding
    functions (``shard_fns``) take it in place of the full tensor."""

    def __init__(self, src: Source, reader: _Reader):
        self.src, self.reader = src, reader
        self.kinds = {"U8"} if src.packed else _SAFE_FLOAT
        # Every header against the config first, so that no concatenation or stacking
        # below ever sees a tensor of the wrong shape.
        shapes = {name: reader.shape(name, expected, self.kinds) for name, expected in src.expected()}
        self.rows = [[shapes[n][0] for n in group] for group in src.parts]
        first = shapes[src.parts[0][0]]
        inner = [sum(r) for r in self.rows]
        self.shape = torch.Size(([len(inner)] if src.stacked else []) + [inner[0], *first[1:]])
        if src.transform is not None:  # another layout: rearranged as it is read
            self.shape = torch.Size(src.ours)

    def dim(self) -> int:
        return len(self.shape)

    def _group(self, g: int, index: tuple) -> torch.Tensor:
        """Rows of group g (its tensors concatenated along dim 0), sliced by ``index``."""
        lo, hi, _ = (index[0] if index else slice(None)).indices(sum(self.rows[g]))
        rest, out, start = index[1:], [], 0
        for name, n in zip(self.src.parts[g], self.rows[g]):
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                out.append(self.reader.get(name, (slice(a - start, b - start), *rest)))
            start += n
        return torch.cat(out, dim=0)

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if self.src.transform is not None:  # expert-major: only the experts asked for are read
            experts = index[0] if index else slice(None)
            parts = [self.reader.get(name, (experts,), self.kinds) for name in self.src.names()]
            return self.src.transform(*parts)[(slice(None), *index[1:])]
        if not self.src.stacked:
            return self._group(0, index)
        experts = range(len(self.src.parts))[index[0]]
        return torch.stack([self._group(g, index[1:]) for g in experts])


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8 w [R, C] and its block scales [ceil(R / br), ceil(C / bc)] -> float32 w * scale."""
    br, bc = block
    s = scale_inv.float().repeat_interleave(br, 0)[:w.shape[0]].repeat_interleave(bc, 1)[:, :w.shape[1]]
    return w.float() * s


def _extremes(t: torch.Tensor) -> torch.Tensor:
    """[min, max] of t: finite exactly when all of t is (both propagate NaN). One pass and
    no [*t.shape] temporary, unlike isfinite(t).all(), several times slower on CPU."""
    return torch.stack(torch.aminmax(t))


def _all_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(_extremes(t)).all())


def _non_finite(src: Source, reader: _Reader, dtype: torch.dtype, ours: str) -> CheckpointError:
    """The error for the first tensor of ``src`` behind non-finite values in our ``ours``."""
    for name in src.names():
        t = reader.get(name)
        if not _all_finite(t):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            return CheckpointError(f"{reader.files[name]}: tensor {name!r} has {nan} NaN and {inf} "
                                   f"infinite values; expected finite weights")
        if not _all_finite(t.to(dtype)):
            return CheckpointError(f"{reader.files[name]}: tensor {name!r} has values up to "
                                   f"{t.abs().max().item():.4g}, beyond the range of {dtype}; "
                                   f"load it in a wider dtype (bfloat16 or float32)")
    # Not reached while the sharding functions only select values; kept so that a future
    # transform cannot turn this into a silent load.
    return CheckpointError(f"{reader.files[src.names()[0]]}: tensors {src.describe()} give {ours} "
                           f"non-finite values")


def load_checkpoint(model: torch.nn.Module, cfg: Config, directory: str | Path, progress: bool = True):
    """Fills every parameter of ``model`` from the checkpoint; all tensors must be used."""
    directory = Path(directory)
    files = safetensors_files(directory)
    family = family_of(read_json(directory / "config.json"), str(directory / "config.json"))
    params = dict(model.named_parameters())
    plan = tensor_plan(cfg, family, list(params))
    quant = read_json(directory / "config.json").get("quantization_config") or {}
    fp8 = tuple(quant.get("weight_block_size") or (128, 128)) if quant.get("quant_method") == "fp8" else None
    reader, used = _Reader(files, fp8), set()
    loaded, extremes = [], []  # per parameter: (name, sources read), [min, max]
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
            read = src.experts(lo, hi)
        lazy = _Lazy(read, reader)
        shard = getattr(module, "shard_fns", {}).get(param)
        if shard is not None and lazy.shape != params[ours].shape:
            tensor = shard(lazy)  # reads only this rank's slice of a parallel weight
        else:
            tensor = lazy[:]
        arrange = getattr(module, "load_fns", {}).get(param)
        if arrange is not None:  # a layout the module keeps otherwise (interleaved rotary pairs as halves)
            tensor = arrange(tensor)
        target = params[ours]
        if tensor.shape != target.shape:
            raise CheckpointError(
                f"{files[src.names()[0]]}: tensors {src.describe()} give {ours} shape "
                f"{list(tensor.shape)}, expected {list(target.shape)} from config.json")
        with torch.no_grad():
            target.copy_(tensor)
        # Checked where the parameter lives (on the GPU: no pass over the host copy), so
        # values that overflow the model's dtype are caught too.
        loaded.append((ours, read))
        extremes.append(_extremes(target))
    # One test (one device sync) for all parameters; only on failure are the sources read
    # again to name the tensor at fault.
    # (Offloaded experts stay in host memory: their extremes join the others' device.)
    finite = (torch.isfinite(torch.stack([e.to(extremes[0].device) for e in extremes])).all(dim=1).tolist()
              if extremes else [])
    if not all(finite):
        ours, read = loaded[finite.index(False)]
        raise _non_finite(read, reader, params[ours].dtype, ours)
    used |= {n + "_scale_inv" for n in used if fp8 and n + "_scale_inv" in files}  # (read with their weights)
    unexpected = sorted(set(files) - used)
    if family.ignored:
        other = [t for t in unexpected if t.startswith(family.ignored)]
        if other:
            unexpected = [t for t in unexpected if not t.startswith(family.ignored)]
            log.warning("%s: the text model alone: %d tensors of %s not read", directory, len(other),
                        " / ".join(p.rstrip(".") for p in family.ignored))
    if family.mtp_layers:
        n = cfg.model.num_layers
        mtp = [t for t in unexpected if (m := re.search(r"\blayers\.(\d+)\.", t)) and int(m.group(1)) >= n]
        if mtp:
            unexpected = [t for t in unexpected if t not in set(mtp)]
            log.warning("%s: skipped %d tensors of the multi-token-prediction layers (layers %d and on): "
                        "decoding uses the main model alone", directory, len(mtp), n)
    pp = getattr(model, "pp", None)
    if pp is not None and pp.size > 1:  # a pipeline stage leaves the others' tensors: only its blocks' count
        own = model.own
        unexpected = [n for n in unexpected if (m := re.search(r"\blayers\.(\d+)\.", n)) and int(m.group(1)) in own]
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r} "
                              f"({len(unexpected)} unused in all) for a {family.name} model with this config")
