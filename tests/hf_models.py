"""Tiny random Hugging Face MoE models, written with save_pretrained, for parity tests."""
from __future__ import annotations

import torch

# Awkward sizes on purpose: hidden not a power of two, GQA ratios 1, 2 and 3, expert
# counts that are not powers of two, an explicit head_dim, tied embeddings, qkv biases.
FAMILIES = {
    "mixtral": dict(cls="MixtralForCausalLM", cfg="MixtralConfig", kw=dict(
        vocab_size=101, hidden_size=72, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, num_local_experts=5, num_experts_per_tok=2,
        max_position_embeddings=96, rope_theta=5000.0, eos_token_id=None, bos_token_id=None)),
    "qwen2_moe": dict(cls="Qwen2MoeForCausalLM", cfg="Qwen2MoeConfig", kw=dict(
        vocab_size=103, hidden_size=60, intermediate_size=44, moe_intermediate_size=20,
        shared_expert_intermediate_size=36, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=6, num_experts=7, num_experts_per_tok=3, mlp_only_layers=[1],
        max_position_embeddings=96, eos_token_id=None)),
    "qwen3_moe": dict(cls="Qwen3MoeForCausalLM", cfg="Qwen3MoeConfig", kw=dict(
        vocab_size=99, hidden_size=56, head_dim=10, intermediate_size=36, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True,
        max_position_embeddings=96, eos_token_id=None)),
    "olmoe": dict(cls="OlmoeForCausalLM", cfg="OlmoeConfig", kw=dict(
        vocab_size=97, hidden_size=84, intermediate_size=28, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, num_experts=9, num_experts_per_tok=3,
        clip_qkv=4.0, max_position_embeddings=96, eos_token_id=None, pad_token_id=None)),
    # GLM-4.5: partial rotary (half of each head), q/k norms and biases, sigmoid scores with a
    # learned bias, grouped top-k (3 groups, 2 kept), a scale, a dense first layer.
    "glm4_moe": dict(cls="Glm4MoeForCausalLM", cfg="Glm4MoeConfig", kw=dict(
        vocab_size=95, hidden_size=60, head_dim=12, intermediate_size=44, moe_intermediate_size=20,
        num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5, n_routed_experts=9,
        num_experts_per_tok=3, n_group=3, topk_group=2, routed_scaling_factor=1.7, n_shared_experts=2,
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, norm_topk_prob=True,
        max_position_embeddings=96, eos_token_id=None, pad_token_id=None)),
    # GPT-OSS: attention sinks, a sliding window (5) on two layers of three, biases on q/k/v/o,
    # the router and the experts, the clamped SwiGLU, softmax over the top-k logits.
    "gpt_oss": dict(cls="GptOssForCausalLM", cfg="GptOssConfig", kw=dict(
        vocab_size=97, hidden_size=60, head_dim=12, intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, num_local_experts=7, num_experts_per_tok=3,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=96, eos_token_id=None, pad_token_id=None)),
    # DeepSeek-V3: latent attention (a q bottleneck, a KV latent of 20, rotary on 8 of each
    # head's 20, values of 14), sigmoid scores with a bias, grouped top-k (3 groups, 2 kept),
    # a scale, two shared experts, a dense first layer.
    "deepseek_v3": dict(cls="DeepseekV3ForCausalLM", cfg="DeepseekV3Config", kw=dict(
        vocab_size=97, hidden_size=60, intermediate_size=44, moe_intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=6, n_routed_experts=9, num_experts_per_tok=3, n_group=3,
        topk_group=2, routed_scaling_factor=1.7, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24,
        kv_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=14, norm_topk_prob=True,
        max_position_embeddings=96, eos_token_id=None, pad_token_id=None, bos_token_id=None)),
    # DeepSeek-V2-Lite style: no q bottleneck, softmax top-k scaled (not renormalized), one
    # shared expert, a dense first layer, complex (interleaved) rotary.
    "deepseek_v2": dict(cls="DeepseekV2ForCausalLM", cfg="DeepseekV2Config", kw=dict(
        vocab_size=97, hidden_size=60, intermediate_size=44, moe_intermediate_size=20, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=6, n_routed_experts=7, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=20, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=14, routed_scaling_factor=1.5, topk_method="greedy",
        max_position_embeddings=96, eos_token_id=None, pad_token_id=None, bos_token_id=None)),
    # Llama 4 (text): MoE every other layer (top-1 sigmoid weights on the expert's input, a
    # shared expert), chunked attention (4 positions) on the rotary layers, a NoPE layer with
    # the attention temperature (floor 3, so it moves within the prompts), L2 q/k norms,
    # interleaved rotary pairs.
    "llama4_text": dict(cls="Llama4ForCausalLM", cfg="Llama4TextConfig", kw=dict(
        vocab_size=97, hidden_size=60, intermediate_size=20, intermediate_size_mlp=44, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=10, num_local_experts=5, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
        max_position_embeddings=96, eos_token_id=None, pad_token_id=None, bos_token_id=None)),
}


def make_hf_model(family: str, seed: int = 0, rope: dict | None = None, **overrides):
    """``rope``: transformers' rope_parameters besides rope_theta (default: unscaled);
    ``overrides``: config keys over the family's."""
    import transformers

    spec = FAMILIES[family]
    kw = {**spec["kw"], **overrides}
    theta = kw.pop("rope_theta", 10000.0)
    cfg = getattr(transformers, spec["cfg"])(**kw)
    partial = (cfg.rope_parameters or {}).get("partial_rotary_factor")  # (GLM-4.5's: 0.5)
    cfg.rope_parameters = {"rope_theta": theta, **(rope or {"rope_type": "default"}),
                           **({"partial_rotary_factor": partial} if partial is not None else {})}
    torch.manual_seed(seed)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    # The per-expert loop is transformers' plain reference; its grouped_mm path needs 16-byte
    # aligned strides (our awkward bf16 sizes are not) and differed on one torch build.
    model.set_experts_implementation("eager")
    # The default init leaves norms at 1 and small weights; randomise everything so a
    # wrong layout or a missed bias cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # a logit beside the scores: large enough to matter
                p.normal_(0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # picks experts: must not stay 0
                b.normal_(0, 0.3)
    return model


def save_hf_model(family: str, path, seed: int = 0, **kw):
    model = make_hf_model(family, seed, **kw)
    model.save_pretrained(path)
    return model
