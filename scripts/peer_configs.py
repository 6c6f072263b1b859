"""transformers configs of a preset's shape, for the benchmarks' peers (transformers'
``generate()``, accelerate offload) and for checking a preset against what the family's
``config.json`` gives."""
from __future__ import annotations

import dataclasses


def rope_parameters(m) -> dict:
    """transformers' ``rope_parameters`` of a ModelConfig's rotary positions and scaling."""
    scaled = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(m.rope_scaling).items()
              if v not in (None, ())} if m.rope_scaling is not None else {"rope_type": "default"}
    return {"rope_theta": m.rope_theta, **scaled}


def hf_config(cfg):
    """A transformers config of the same shape (Mixtral, Qwen3-MoE, OLMoE, GLM-4.5, GPT-OSS or
    DeepSeek-V2), or None."""
    import transformers

    m, e = cfg.model, cfg.moe
    glm = e is not None and e.score_bias
    if e is not None and m.kv_lora_rank is not None and not e.score_bias:  # DeepSeek-V2 (greedy routing)
        c = transformers.DeepseekV2Config(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, intermediate_size=m.ffn_hidden,
            moe_intermediate_size=e.expert_hidden, n_routed_experts=e.num_experts, num_experts_per_tok=e.top_k,
            n_shared_experts=e.shared_experts, first_k_dense_replace=e.first_dense, q_lora_rank=m.q_lora_rank,
            kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.rotary_width, qk_nope_head_dim=m.head_dim - m.rotary_width,
            v_head_dim=m.v_head_dim, routed_scaling_factor=e.routed_scaling_factor, topk_method="greedy",
            max_position_embeddings=m.max_position, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tied_embeddings,
            bos_token_id=m.bos_token_id, eos_token_id=list(m.eos_token_ids) or None)
        c.rope_parameters = rope_parameters(m)
        return c
    if e is None or m.positions != "rope" or (e.shared_experts and not glm):
        return None
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                  max_position_embeddings=m.max_position, rms_norm_eps=m.norm_eps,
                  num_experts_per_tok=e.top_k, tie_word_embeddings=m.tied_embeddings)
    if glm:
        c = transformers.Glm4MoeConfig(**common, intermediate_size=m.ffn_hidden, moe_intermediate_size=e.expert_hidden,
                                       n_routed_experts=e.num_experts, n_shared_experts=e.shared_experts,
                                       first_k_dense_replace=e.first_dense, n_group=e.n_group, topk_group=e.topk_group,
                                       routed_scaling_factor=e.routed_scaling_factor, norm_topk_prob=e.renormalize,
                                       use_qk_norm=m.qk_norm == "head", attention_bias=m.qkv_bias)
        c.rope_parameters = {"rope_type": "default", "rope_theta": m.rope_theta,
                             "partial_rotary_factor": m.rotary_width / m.head_dim}
        return c
    if m.attention_sinks:
        sliding = set(m.sliding_layers) if m.sliding_layers else set(range(m.num_layers) if m.sliding_window else ())
        c = transformers.GptOssConfig(**common, intermediate_size=e.expert_hidden, num_local_experts=e.num_experts,
                                      sliding_window=m.sliding_window, attention_bias=m.qkv_bias,
                                      layer_types=["sliding_attention" if i in sliding else "full_attention"
                                                   for i in range(m.num_layers)])
    elif m.qk_norm == "full":
        c = transformers.OlmoeConfig(**common, intermediate_size=e.expert_hidden, num_experts=e.num_experts,
                                     norm_topk_prob=e.renormalize)
    elif m.qk_norm == "head":
        c = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=e.expert_hidden, num_experts=e.num_experts,
                                        intermediate_size=m.ffn_hidden, norm_topk_prob=e.renormalize)
    else:
        c = transformers.MixtralConfig(**common, intermediate_size=e.expert_hidden, num_local_experts=e.num_experts)
    c.rope_parameters = rope_parameters(m)
    return c
