"""How a model routes its tokens: each MoE layer's count of picks per routed expert over a
set of prompts (``measure``; ``moe-infer routing`` writes it as JSON), and that file read
back for the cost model (``load``; ``moe-infer plan --routing``), which then prices a step's
experts by the distinct experts such routing hits in place of uniform routing's. Where a
router favours some experts, a batch hits fewer of them than uniform routing would, and a
step reads fewer weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_infer.config import Config, ConfigError


def measure(engine, prompts: list[list[int]]) -> dict:
    """Each MoE layer's picks per routed expert (the top-k slots; shared experts folded into
    the routed call are left out) over ``prompts`` (token id lists), one eager forward a
    prompt, so no padding token is counted. -> the JSON-ready record ``load`` reads."""
    cfg = engine.config
    e = cfg.moe
    if e is None:
        raise ConfigError(f"model {cfg.name!r}: not a mixture of experts, it has no routing to count")
    counts: dict[int, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(engine.model.layers):
        router = getattr(getattr(block, "ffn", None), "router", None)
        if router is None:  # a dense block, or another pipeline stage's
            continue
        counts[i] = torch.zeros(e.num_experts, dtype=torch.long)

        def count(module, args, routing, i=i):
            picks = routing.expert_ids[:, :module.top_k].reshape(-1).long().cpu()
            counts[i] += torch.bincount(picks, minlength=e.num_experts)[:e.num_experts]
        hooks.append(router.register_forward_hook(count))
    try:
        with torch.no_grad():
            for ids in prompts:
                engine.logits([ids])
    finally:
        for h in hooks:
            h.remove()
    return {"model": cfg.name, "num_experts": e.num_experts, "top_k": e.top_k, "prompts": len(prompts),
            "tokens": sum(map(len, prompts)), "layers": {str(i): c.tolist() for i, c in counts.items()}}


def load(path: str | Path, cfg: Config) -> dict[int, list[float]]:
    """A ``measure`` record from ``path`` -> {MoE layer: picks per expert}, checked against
    the model ``cfg`` (its expert count, its MoE layers); a layer the file lacks is priced
    as uniform routing."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--routing {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"--routing {path}: not JSON ({exc})") from None
    e = cfg.moe
    if e is None:
        raise ConfigError(f"--routing {path}: model {cfg.name!r} has no experts to route")
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
        raise ConfigError(f"--routing {path}: expected a record of moe-infer routing (a 'layers' object)")
    if data.get("num_experts") != e.num_experts:
        raise ConfigError(f"--routing {path}: num_experts={data.get('num_experts')!r}, expected the model's "
                          f"{e.num_experts}")
    out = {}
    for key, picks in data["layers"].items():
        where = f"--routing {path}: layers[{key!r}]"
        if not key.isdigit() or int(key) >= cfg.model.num_layers or not cfg.is_moe_layer(int(key)):
            raise ConfigError(f"{where}: not a MoE layer of {cfg.name!r} ({cfg.model.num_layers} layers)")
        if (not isinstance(picks, list) or len(picks) != e.num_experts
                or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0 for n in picks)
                or sum(picks) <= 0):
            raise ConfigError(f"{where}: expected {e.num_experts} pick counts >= 0, not all 0")
        out[int(key)] = [float(n) for n in picks]
    return out
