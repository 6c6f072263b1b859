"""Hugging Face MoE checkpoints: ``config.json`` -> ``Config``, and where each of our
tensors comes from in the checkpoint's safetensors.

Families: Mixtral, Qwen2-MoE (Qwen1.5-MoE), Qwen3-MoE, OLMoE, GLM-4.5, GPT-OSS, Llama 4 (text),
DeepSeek-V2 (greedy routing) and V3 (and Kimi K2, V3's architecture). Per-expert
tensors are stacked into ``w13 [E, 2F, H]`` (gate rows, then up rows) and ``w2 [E, H, F]``
(GPT-OSS's fused, transposed and interleaved ones rearranged so); q, k and v are
concatenated into one ``qkv_proj``. Each checkpoint tensor comes with the shape
the config implies for it, so that a wrong one is named before anything is joined.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from kernels.moe.mxfp4 import dequantize_mxfp4
from moe_infer.config import ROPE_TYPES, Config, ConfigError, EngineConfig, ModelConfig, MoEConfig, RopeScaling
from moe_infer.config_files import section_from_dict


@dataclass(frozen=True)
class Family:
    name: str
    moe_prefix: str  # module name of the sparse block inside a layer
    expert_names: tuple[str, str, str]  # gate, up, down projection names of one expert
    defaults: dict  # the transformers config class defaults that matter when a key is absent
    # A multimodal checkpoint's text model (Llama 4's): its config under ``text_config``, its
    # tensors under ``prefix``; the tensors under ``ignored`` (the vision tower) stay unread.
    prefix: str = ""
    ignored: tuple[str, ...] = ()
    # Tensors of layers past the model's last are multi-token-prediction layers (DeepSeek-V3),
    # skipped: decoding uses the main model alone.
    mtp_layers: bool = False


_LLAMA4 = {"rms_norm_eps": 1e-5, "attention_bias": False, "use_qk_norm": True, "attn_temperature_tuning": True,
           "floor_scale": 8192, "attn_scale": 0.1, "attention_chunk_size": 8192, "interleave_moe_layer_step": 1}
FAMILIES = {
    "mixtral": Family("mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
                      {"rms_norm_eps": 1e-5, "sliding_window": None}),
    "qwen2_moe": Family("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                        {"rms_norm_eps": 1e-6, "norm_topk_prob": False, "qkv_bias": True,
                         "decoder_sparse_step": 1, "use_sliding_window": False}),
    "qwen3_moe": Family("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                        {"rms_norm_eps": 1e-6, "norm_topk_prob": False, "attention_bias": False,
                         "decoder_sparse_step": 1, "use_sliding_window": False}),
    "olmoe": Family("olmoe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                    {"rms_norm_eps": 1e-5, "norm_topk_prob": False, "attention_bias": False,
                     "clip_qkv": None}),
    "glm4_moe": Family("glm4_moe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                       {"rms_norm_eps": 1e-5, "norm_topk_prob": True, "attention_bias": False, "use_qk_norm": False,
                        "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                        "first_k_dense_replace": 1, "n_shared_experts": 1}),
    "gpt_oss": Family("gpt_oss", "mlp", ("gate_proj", "up_proj", "down_proj"),
                      {"rms_norm_eps": 1e-5, "attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0,
                       "swiglu_alpha": 1.702}),
    "deepseek_v3": Family("deepseek_v3", "mlp", ("gate_proj", "up_proj", "down_proj"),
                          {"rms_norm_eps": 1e-6, "attention_bias": False, "norm_topk_prob": True, "n_group": 1,
                           "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
                           "n_shared_experts": 0, "rope_interleave": True, "q_lora_rank": None}, mtp_layers=True),
    "deepseek_v2": Family("deepseek_v2", "mlp", ("gate_proj", "up_proj", "down_proj"),
                          {"rms_norm_eps": 1e-6, "attention_bias": False, "routed_scaling_factor": 1.0,
                           "first_k_dense_replace": 0, "n_shared_experts": 0, "q_lora_rank": None,
                           "topk_method": "greedy"}),
    "llama4_text": Family("llama4_text", "feed_forward", ("gate_proj", "up_proj", "down_proj"), _LLAMA4),
    "llama4": Family("llama4_text", "feed_forward", ("gate_proj", "up_proj", "down_proj"), _LLAMA4,
                     prefix="language_model.", ignored=("vision_model.", "multi_modal_projector.")),
}
_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe", "Glm4MoeForCausalLM": "glm4_moe",
                  "GptOssForCausalLM": "gpt_oss", "Llama4ForCausalLM": "llama4_text",
                  "Llama4ForConditionalGeneration": "llama4",
                  "DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (a checkpoint directory needs config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def family_of(hf: dict, source: str) -> Family:
    names = [hf.get("model_type")] + [_ARCHITECTURES.get(a) for a in hf.get("architectures") or []]
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise ConfigError(f"{source}: model_type={hf.get('model_type')!r}, architectures="
                      f"{hf.get('architectures')!r}: expected one of {', '.join(_ARCHITECTURES)}")


_ROPE_KEYS = ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "truncate", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor")


def _rope(hf: dict, source: str, partial_default: float = 1.0) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, the scaling, the share of each head that turns) from ``rope_parameters``
    (transformers 5) or ``rope_scaling`` (older configs: ``type`` or ``rope_type``); a key
    it does not know is refused."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", partial_default)))
    if not 0 < partial <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor={partial}: expected a share in (0, 1]")
    if kind == "default":
        return theta, None, partial
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type={kind!r}: expected default or one of {', '.join(ROPE_TYPES)}")
    unknown = sorted(k for k in rope if k not in _ROPE_KEYS)
    if unknown:
        raise ConfigError(f"{source}: rope parameter {unknown[0]!r} of rope_type {kind}: expected only "
                          f"{', '.join(_ROPE_KEYS)}")
    if rope.get("original_max_position_embeddings") is None and hf.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return theta, section_from_dict(RopeScaling, {"rope_type": kind, **{k: v for k, v in rope.items()
                                                                         if v is not None}}, f"{source}: rope"), partial


def _token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def config_from_hf(hf: dict, source: str = "config.json") -> Config:
    fam = family_of(hf, source)
    if fam.prefix:  # the text model of a multimodal checkpoint
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError(f"{source}: text_config: expected the text model's config (a {fam.name} model)")
        hf = {**hf["text_config"], "model_type": fam.name}
    get = lambda key: hf[key] if key in hf else fam.defaults.get(key)  # noqa: E731
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act={hf['hidden_act']!r}: expected 'silu'")
    sliding = get("sliding_window")
    theta, scaling, partial = _rope(hf, source, fam.defaults.get("partial_rotary_factor", 1.0))
    glm, gpt = fam.name == "glm4_moe", fam.name == "gpt_oss"
    ds, v2 = fam.name in ("deepseek_v2", "deepseek_v3"), fam.name == "deepseek_v2"
    if fam.name in ("qwen2_moe", "qwen3_moe") and not get("use_sliding_window"):
        sliding = None
    sliding_layers = ()
    if gpt:
        sliding, sliding_layers = _gpt_oss_layers(hf, sliding, source)
    llama4 = fam.name == "llama4_text"
    attention = _llama4_layers(hf, get, source) if llama4 else {}
    try:
        # transformers writes either name, depending on the family and version.
        num_experts = hf["n_routed_experts"] if glm or ds else hf["num_local_experts"] if "num_local_experts" in hf \
            else hf["num_experts"]
        expert_width = hf["intermediate_size"] if fam.name in ("mixtral", "olmoe", "gpt_oss", "llama4_text") \
            else hf["moe_intermediate_size"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary_dim = int(head_dim * partial)
        latent = {}
        if ds:  # latent attention: a query / key head is nope + rope wide, its rotary part rope
            head_dim, rotary_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["qk_rope_head_dim"]
            latent = dict(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=get("q_lora_rank"),
                          v_head_dim=hf["v_head_dim"], rope_interleaved=v2 or bool(get("rope_interleave")))
            method, want = get("topk_method"), ("greedy", "group_limited_greedy") if v2 else (None, "noaux_tc")
            if method not in want:
                raise ConfigError(f"topk_method={method!r}: expected {' or '.join(repr(w) for w in want if w)} "
                                  f"({fam.name}'s routing)")
        if rotary_dim % 2 or rotary_dim == 0:
            raise ConfigError(f"partial_rotary_factor={partial}: {rotary_dim} of head_dim={head_dim} turn, "
                              f"expected an even, positive number")
        model = ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_attention_heads"] if ds else hf.get("num_key_value_heads"),
            head_dim=head_dim if ds else hf.get("head_dim"),
            ffn_hidden=hf["intermediate_size_mlp" if llama4 else "intermediate_size"], norm="rmsnorm",
            norm_eps=get("rms_norm_eps"),
            activation="swiglu_oai" if gpt else "swiglu", positions="rope", rope_theta=theta, rope_scaling=scaling,
            max_position=hf.get("max_position_embeddings", 4096),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            qk_norm="head" if glm and get("use_qk_norm") else "l2" if llama4 and get("use_qk_norm")
            else {"qwen3_moe": "head", "olmoe": "full"}.get(fam.name, "none"),
            qkv_bias=bool(get("qkv_bias") if fam.name == "qwen2_moe" else get("attention_bias")),
            out_bias=bool(get("attention_bias")) if fam.name in ("qwen3_moe", "olmoe", "gpt_oss", "llama4_text")
            or ds else False,
            sliding_window=sliding, sliding_layers=sliding_layers, attention_sinks=gpt, clip_qkv=get("clip_qkv"),
            **attention, **latent,
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=_token_ids(hf.get("eos_token_id")))
        shared = hf.get("shared_expert_intermediate_size", 0) if fam.name == "qwen2_moe" else 0
        if v2:  # softmax top-k (in the best groups, by their best expert), not renormalized, scaled
            limited = get("topk_method") == "group_limited_greedy"
            moe = MoEConfig(
                num_experts=num_experts, top_k=hf["num_experts_per_tok"], expert_hidden=expert_width,
                first_dense=get("first_k_dense_replace"), shared_experts=get("n_shared_experts"),
                shared_expert_hidden=expert_width, score="softmax", renormalize=False,
                routed_scaling_factor=float(get("routed_scaling_factor")),
                n_group=hf["n_group"] if limited else 1, topk_group=hf["topk_group"] if limited else 1,
                group_score="max" if limited else "top2")
        elif glm or ds:  # sigmoid scores, a score bias, grouped top-k, plain shared experts, dense first layers
            moe = MoEConfig(
                num_experts=num_experts, top_k=hf["num_experts_per_tok"], expert_hidden=expert_width,
                first_dense=get("first_k_dense_replace"), shared_experts=get("n_shared_experts"),
                shared_expert_hidden=expert_width, score="sigmoid", renormalize=bool(get("norm_topk_prob")),
                score_bias=True, n_group=get("n_group"), topk_group=get("topk_group"),
                routed_scaling_factor=float(get("routed_scaling_factor")))
        elif llama4:  # top-k of sigmoid scores (no renormalizing) on the expert's input, a shared expert
            moe_layers = set(hf.get("moe_layers") or range(get("interleave_moe_layer_step") - 1,
                                                           hf["num_hidden_layers"], get("interleave_moe_layer_step")))
            moe = MoEConfig(
                num_experts=num_experts, top_k=hf["num_experts_per_tok"], expert_hidden=expert_width,
                dense_layers=tuple(i for i in range(hf["num_hidden_layers"]) if i not in moe_layers),
                shared_experts=1, shared_expert_hidden=expert_width, score="sigmoid", renormalize=False,
                weighted_input=True)
        else:
            moe = MoEConfig(
                num_experts=num_experts, top_k=hf["num_experts_per_tok"], expert_hidden=expert_width,
                every=get("decoder_sparse_step") or 1, dense_layers=tuple(hf.get("mlp_only_layers") or ()),
                shared_experts=1 if shared else 0, shared_expert_hidden=shared,
                shared_expert_gate=bool(shared), score="softmax",
                # GPT-OSS's softmax over the top-k logits is the softmax renormalized over them
                renormalize=True if fam.name in ("mixtral", "gpt_oss") else bool(get("norm_topk_prob")),
                router_bias=gpt, expert_bias=gpt)
    except KeyError as exc:
        raise ConfigError(f"{source}: missing key {exc.args[0]!r} required for {fam.name}") from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return Config(model=model, moe=moe, name=fam.name,
                  engine=EngineConfig(max_seq_len=model.max_position))


def _gpt_oss_layers(hf: dict, window: int | None, source: str) -> tuple[int | None, tuple[int, ...]]:
    """GPT-OSS's (sliding window, the layers that use it) from ``layer_types``; its SwiGLU's
    clamp and slope checked against the ones the kernels compute, and its quantization
    (MXFP4 or none)."""
    for key, value in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        if float(hf.get(key, value)) != value:
            raise ConfigError(f"{source}: {key}={hf[key]}: expected {value} (GPT-OSS's clamped SwiGLU)")
    q = hf.get("quantization_config")
    if q:
        if q.get("quant_method") != "mxfp4":
            raise ConfigError(f"{source}: quantization_config quant_method={q.get('quant_method')!r}: expected "
                              f"mxfp4 or an unquantized checkpoint")
        for key in ("hidden_size", "intermediate_size"):
            if hf.get(key, 0) % 32:
                raise ConfigError(f"{source}: {key}={hf[key]}: expected a multiple of 32 (MXFP4 groups of 32)")
    n = hf.get("num_hidden_layers", 0)
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
    if bad or len(types) != n:
        raise ConfigError(f"{source}: layer_types={types!r}: expected num_hidden_layers={n} entries of "
                          f"'sliding_attention' or 'full_attention'")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding or window is None:
        return None, ()
    return window, (() if len(sliding) == n else sliding)


def _llama4_layers(hf: dict, get, source: str) -> dict:
    """Llama 4's per-layer attention: the chunked layers (``layer_types``), the NoPE ones
    (``no_rope_layers``: 0 where a layer has no rotary positions) and their temperature."""
    n = hf["num_hidden_layers"]
    rope = hf.get("no_rope_layers") or [1] * n
    types = hf.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in rope]
    if len(rope) != n or len(types) != n or any(t not in ("chunked_attention", "full_attention") for t in types):
        raise ConfigError(f"{source}: no_rope_layers={rope!r}, layer_types={types!r}: expected "
                          f"num_hidden_layers={n} entries each ('chunked_attention' or 'full_attention')")
    chunk = get("attention_chunk_size")
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention") if chunk else ()
    nope = tuple(i for i, r in enumerate(rope) if not r)
    temperature = (float(get("floor_scale")), float(get("attn_scale"))) if get("attn_temperature_tuning") else None
    return dict(attention_chunk=chunk if chunked else None, chunked_layers=chunked, nope_layers=nope,
                nope_temperature=temperature if nope else None, rope_interleaved=True)


def read_hf_config(checkpoint_dir: str | Path) -> Config:
    path = Path(checkpoint_dir) / "config.json"
    cfg = config_from_hf(read_json(path), str(path))
    cfg.checkpoint = str(checkpoint_dir)
    return cfg


# ------------------------------------------------------------------- tensor name plan

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors that make one of ours: ``parts[i]`` are concatenated along dim 0,
    and the results stacked along a new dim 0 when ``stacked`` (one entry per expert).
    ``shapes[i][j]`` is the whole shape the config implies for ``parts[i][j]``: the file
    holds every tensor whole whatever slice a rank keeps, so it is checked before any read."""

    parts: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[Shape, ...], ...]
    stacked: bool = False
    # A checkpoint layout other than ours (GPT-OSS's experts): ``transform`` turns the
    # tensors read (each part, expert-major, the experts asked for) into ours, of shape
    # ``ours``; ``packed``: the parts are bytes (MXFP4 blocks and scales), not floats.
    transform: Callable[..., torch.Tensor] | None = None
    ours: Shape | None = None
    packed: bool = False

    def __post_init__(self):
        if [len(g) for g in self.parts] != [len(g) for g in self.shapes]:
            raise ValueError(f"Source {self.parts}: shapes {self.shapes} do not pair with the names")

    def names(self) -> list[str]:
        return [n for group in self.parts for n in group]

    def expected(self) -> list[tuple[str, Shape]]:
        """(checkpoint name, expected shape) for every tensor, in read order."""
        return [pair for names, shapes in zip(self.parts, self.shapes) for pair in zip(names, shapes)]

    def experts(self, first: int, end: int) -> Source:
        """The per-expert source of experts first .. end - 1 only."""
        return Source(self.parts[first:end], self.shapes[first:end], stacked=True)

    def describe(self) -> str:
        names = self.names()
        if len(names) <= 3:
            return " + ".join(repr(n) for n in names)
        return f"{names[0]!r} .. {names[-1]!r} ({len(names)} tensors)"


def one(name: str, shape: Shape) -> Source:
    return Source(((name,),), ((shape,),))


def _uninterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2F] with gate and up alternating (GPT-OSS) -> [..., 2F]: gate, then up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _gate_up(t: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gate_up_proj [E, H, 2F] (interleaved) -> our w13 [E, 2F, H]."""
    return _uninterleave(t).transpose(1, 2).contiguous()


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Experts stored [E, K, N] (GPT-OSS's down_proj, Llama 4's both) -> ours, [E, N, K]."""
    return t.transpose(1, 2).contiguous()


def rearranged(name: str, shape: Shape, transform, ours: Shape) -> Source:
    return Source(((name,),), ((shape,),), transform=transform, ours=ours)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., R, G, 16] uint8 (two e2m1 codes a byte, the low nibble first) and
    scales [..., R, G] uint8 (a power of two, exponent bias 127) -> bfloat16 [..., R, 32 G].
    bf16 holds every such value exactly (a 2-bit mantissa, fp32's exponent range)."""
    return dequantize_mxfp4(blocks.flatten(-2), scales, torch.bfloat16)


def _mxfp4_gate_up(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's MXFP4 gate_up_proj ([E, 2F, H] once unpacked, gate and up rows alternating)
    -> our w13 [E, 2F, H]."""
    return _uninterleave(mxfp4(blocks, scales).transpose(1, 2)).transpose(1, 2).contiguous()


def _raw_mxfp4(m: str, ours: str, e: int, h: int, f: int) -> Source:
    """Our ``ours`` (experts.w13 / w13_scale / w2 / w2_scale of ``Mxfp4Experts``) from GPT-OSS's
    MXFP4 blocks or scales as stored: gate_up's rows (gate and up alternating) put gate rows
    first, the 16-byte blocks of a row joined."""
    name, rows, k = ((m + "experts.gate_up_proj", (e, 2 * f), h) if ours.startswith("ffn.experts.w13")
                     else (m + "experts.down_proj", (e, h), f))
    gate_up = name.endswith("gate_up_proj")

    def arrange(t: torch.Tensor) -> torch.Tensor:
        t = _uninterleave(t.transpose(1, -1)).transpose(1, -1) if gate_up else t  # rows are dim 1
        return t.flatten(2).contiguous()

    if ours.endswith("_scale"):
        return Source(((name + "_scales",),), (((*rows, k // 32),),), transform=arrange, ours=(*rows, k // 32),
                      packed=True)
    return Source(((name + "_blocks",),), (((*rows, k // 32, 16),),), transform=arrange, ours=(*rows, k // 2),
                  packed=True)


def packed(name: str, rows: Shape, transform, ours: Shape) -> Source:
    """An MXFP4 tensor (``name``_blocks, ``name``_scales) whose unpacked shape is ``rows`` +
    [K], K = ours[-1] (packed along the GEMM's reduction)."""
    k = ours[-1]
    return Source(((name + "_blocks", name + "_scales"),), (((*rows, k // 32, 16), (*rows, k // 32)),),
                  transform=transform, ours=ours, packed=True)


def tensor_plan(cfg: Config, family: Family, our_names: list[str]) -> dict[str, list[Source]]:
    """For each of our parameter names, the checkpoint sources to try in order (a
    per-expert layout first, then a layout with experts already fused)."""
    plan = {}
    packed = any(n.endswith("ffn.experts.w13_scale") for n in our_names)  # MXFP4 experts read as they are
    for ours in our_names:
        plan[ours] = _sources(ours, cfg, family, packed)
        if family.prefix:
            plan[ours] = [replace(s, parts=tuple(tuple(family.prefix + n for n in g) for g in s.parts))
                          for s in plan[ours]]
    return plan


def _sources(ours: str, cfg: Config, fam: Family, packed_experts: bool = False) -> list[Source]:
    m_cfg = cfg.model
    h, v, d = m_cfg.hidden_size, m_cfg.vocab_size, m_cfg.head_dim
    q, kv = m_cfg.num_heads * d, m_cfg.num_kv_heads * d  # q rows; k rows = v rows
    top = {"embed.weight": ("model.embed_tokens.weight", (v, h)), "norm.weight": ("model.norm.weight", (h,)),
           "lm_head.weight": ("lm_head.weight", (v, h))}
    if ours in top:
        return [one(*top[ours])]
    parts = ours.split(".")  # layers.{i}.<module path>.<weight|bias>
    i, rest = int(parts[1]), ".".join(parts[2:])
    p = f"model.layers.{i}."
    attn = {"attn_norm.weight": ("input_layernorm.weight", (h,)),
            "ffn_norm.weight": ("post_attention_layernorm.weight", (h,)),
            "attn.o_proj.weight": ("self_attn.o_proj.weight", (h, q)),
            "attn.o_proj.bias": ("self_attn.o_proj.bias", (h,))}
    if m_cfg.kv_lora_rank is not None and rest.startswith("attn."):  # latent attention (DeepSeek)
        n, r, c, ql, v_ = (m_cfg.num_heads, m_cfg.rotary_width, m_cfg.kv_lora_rank, m_cfg.q_lora_rank,
                           m_cfg.v_head_dim)
        mla = {"attn.q_a_proj.weight": ("q_a_proj.weight", (ql, h)), "attn.q_a_proj.bias": ("q_a_proj.bias", (ql,)),
               "attn.q_a_norm.weight": ("q_a_layernorm.weight", (ql,)),
               "attn.q_b_proj.weight": ("q_b_proj.weight", (n * d, ql)),
               "attn.q_proj.weight": ("q_proj.weight", (n * d, h)),
               "attn.kv_a_proj.weight": ("kv_a_proj_with_mqa.weight", (c + r, h)),
               "attn.kv_a_proj.bias": ("kv_a_proj_with_mqa.bias", (c + r,)),
               "attn.kv_a_norm.weight": ("kv_a_layernorm.weight", (c,)),
               "attn.kv_b_proj.weight": ("kv_b_proj.weight", (n * (d - r + v_), c)),
               "attn.o_proj.weight": ("o_proj.weight", (h, n * v_)), "attn.o_proj.bias": ("o_proj.bias", (h,))}
        if rest in mla:
            name, shape = mla[rest]
            return [one(f"{p}self_attn.{name}", shape)]
    if rest == "attn.sinks":
        return [one(p + "self_attn.sinks", (m_cfg.num_heads,))]
    if rest in ("attn.q_norm.weight", "attn.k_norm.weight"):
        norm = rest.split(".")[1]
        # Over one head (Qwen3) or over all heads together (OLMoE).
        width = d if m_cfg.qk_norm == "head" else (q if norm == "q_norm" else kv)
        return [one(f"{p}self_attn.{norm}.weight", (width,))]
    if rest in attn:
        name, shape = attn[rest]
        return [one(p + name, shape)]
    if rest.startswith("attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        cols = (h,) if kind == "weight" else ()
        return [Source((tuple(f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"),),
                       (((q, *cols), (kv, *cols), (kv, *cols)),))]
    gate, up, down = fam.expert_names
    m = p + fam.moe_prefix + "."
    e, f = (cfg.moe.num_experts, cfg.moe.expert_hidden) if cfg.moe else (0, 0)
    if fam.name == "llama4_text":  # fused experts [E, H, 2F] (gate, then up) and [E, F, H]
        llama = {"ffn.experts.w13": rearranged(m + "experts.gate_up_proj", (e, h, 2 * f), _transposed, (e, 2 * f, h)),
                 "ffn.experts.w2": rearranged(m + "experts.down_proj", (e, f, h), _transposed, (e, h, f)),
                 "ffn.router.weight": one(m + "router.weight", (e, h))}
        if rest in llama:
            return [llama[rest]]
    if fam.name == "gpt_oss":
        gpt = {"ffn.router.weight": one(m + "router.weight", (e, h)), "ffn.router.bias": one(m + "router.bias", (e,)),
               "ffn.experts.b13": rearranged(m + "experts.gate_up_proj_bias", (e, 2 * f), _uninterleave, (e, 2 * f)),
               "ffn.experts.b2": one(m + "experts.down_proj_bias", (e, h))}
        if rest in gpt:
            return [gpt[rest]]
        if packed_experts and rest.startswith("ffn.experts.w"):  # MXFP4 kept: codes and scales as stored
            return [_raw_mxfp4(m, rest, e, h, f)]
        if rest == "ffn.experts.w13":  # bf16 / fp32, or MXFP4 (dequantized as it is read)
            return [rearranged(m + "experts.gate_up_proj", (e, h, 2 * f), _gate_up, (e, 2 * f, h)),
                    packed(m + "experts.gate_up_proj", (e, 2 * f), _mxfp4_gate_up, (e, 2 * f, h))]
        if rest == "ffn.experts.w2":
            return [rearranged(m + "experts.down_proj", (e, f, h), _transposed, (e, h, f)),
                    packed(m + "experts.down_proj", (e, h), mxfp4, (e, h, f))]
    if rest == "ffn.router.weight":
        return [one(m + "gate.weight", (e, h))]
    if rest == "ffn.router.score_bias":
        return [one(m + "gate.e_score_correction_bias", (e,))]
    if rest == "ffn.experts.w13":
        per_expert = Source(tuple((f"{m}experts.{j}.{gate}.weight", f"{m}experts.{j}.{up}.weight")
                                  for j in range(e)), (((f, h), (f, h)),) * e, stacked=True)
        return [per_expert, one(m + "experts.gate_up_proj", (e, 2 * f, h))]
    if rest == "ffn.experts.w2":
        per_expert = Source(tuple((f"{m}experts.{j}.{down}.weight",) for j in range(e)), (((h, f),),) * e,
                            stacked=True)
        return [per_expert, one(m + "experts.down_proj", (e, h, f))]
    shared = cfg.moe.shared_experts * cfg.moe.shared_expert_hidden if cfg.moe else 0
    s = m + ("shared_experts." if fam.name in ("glm4_moe", "deepseek_v2", "deepseek_v3") else "shared_expert.")
    if rest == "ffn.shared.up_proj.weight":
        return [Source(((s + "gate_proj.weight", s + "up_proj.weight"),), (((shared, h), (shared, h)),))]
    if rest == "ffn.shared.down_proj.weight":
        return [one(s + "down_proj.weight", (h, shared))]
    if rest == "ffn.shared_gate.weight":
        return [one(m + "shared_expert_gate.weight", (1, h))]
    # A dense layer of an MoE model (Qwen2/3 mlp_only_layers).
    if rest == "ffn.up_proj.weight":
        width = m_cfg.ffn_hidden
        return [Source(((m + "gate_proj.weight", m + "up_proj.weight"),), (((width, h), (width, h)),))]
    if rest == "ffn.down_proj.weight":
        return [one(m + "down_proj.weight", (h, m_cfg.ffn_hidden))]
    raise ConfigError(f"{ours}: no Hugging Face {fam.name} tensor maps to this parameter")
