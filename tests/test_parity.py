"""Checkpoint parity with transformers for the four MoE families, on ragged batches."""
import copy

import pytest
import torch

import moe_infer
from hf_models import FAMILIES, save_hf_model
from parity import check_logits, rel_err

# Relative-norm tolerance between two runs of ours; bf16 rounds every GEMM input.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
PROMPTS = [[5, 17, 3, 44, 12, 9, 31], [8, 2], [60, 1, 19, 27, 4], [33]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_hf_model(request.param, path)
    return request.param, path, model


def test_logits_match_transformers_on_ragged_batch(checkpoint, device_dtype):
    family, path, hf = checkpoint
    device, dtype = device_dtype
    engine = moe_infer.load(path, device=device, dtype=dtype, progress=False)
    exact = moe_infer.load(path, device="cpu", dtype=torch.float32, progress=False)
    check_logits(engine, exact, hf, PROMPTS, family)


def test_left_and_right_padding_agree(checkpoint, device_dtype):
    _, path, _ = checkpoint
    device, dtype = device_dtype
    engine = moe_infer.load(path, device=device, dtype=dtype, progress=False)
    width = max(map(len, PROMPTS))
    left = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    left_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out_left = engine.logits(left, left_mask)
    out_right = engine.logits(PROMPTS)
    for i, p in enumerate(PROMPTS):
        assert rel_err(out_left[i, width - len(p):], out_right[i, :len(p)]) < TOL[dtype]


def greedy_reference(hf, prompt, n, device):
    """Greedy tokens from repeated full forwards of the transformers model (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_same_or_near_tie(ours, ref, hf, prompt, dtype, device):
    """Equal greedy tokens; in bf16 a divergence is allowed only where our token is within
    bf16 rounding of the best one under the exact (float32) reference logits: a near-tie.
    (transformers' own bf16 logits are no judge of it: they carry the same rounding.)"""
    if ours == ref:
        return
    assert dtype != torch.float32, f"greedy mismatch in fp32: {ours} vs {ref}"
    j = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
    exact = copy.deepcopy(hf).float()
    with torch.no_grad():
        logits = exact(torch.tensor([prompt + ref[:j]], device=device)).logits[0, -1].float()
    margin = (logits.max() - logits[ours[j]]).item()
    assert margin < 0.05 * logits.abs().max().item(), f"diverged at {j} with margin {margin}"


def test_greedy_generation_matches_transformers(checkpoint, device_dtype):
    family, path, hf = checkpoint
    device, dtype = device_dtype
    engine = moe_infer.load(path, device=device, dtype=dtype, progress=False)
    hf = copy.deepcopy(hf).to(device=device, dtype=dtype)
    outs = engine.generate(PROMPTS, max_new_tokens=8)  # one left-padded batch
    for p, out in zip(PROMPTS, outs):
        assert out.finish_reason == "length" and len(out.token_ids) == 8
        assert_same_or_near_tie(out.token_ids, greedy_reference(hf, p, 8, device), hf, p, dtype, device)


def test_deepseek_v2_group_limited_routing_matches_transformers(tmp_path):
    """DeepSeek-V2's group-limited greedy routing (the 236B model's): experts only in the
    topk_group groups whose best expert scores highest."""
    hf = save_hf_model("deepseek_v2", tmp_path, topk_method="group_limited_greedy", n_routed_experts=8, n_group=4,
                       topk_group=2)
    engine = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert engine.config.moe.n_group == 4 and engine.config.moe.group_score == "max"
    for p in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].double()
        assert rel_err(engine.logits([p])[0, :len(p)], ref) < 1e-4


def test_llama4_multimodal_checkpoint_serves_its_text_model(tmp_path, caplog):
    """Llama 4 as released (Llama4ForConditionalGeneration): the text model's config under
    text_config, its tensors under language_model.; the vision tower is left unread, with a
    note. Text logits equal transformers' on token ids alone."""
    import transformers

    from hf_models import FAMILIES

    text = dict(FAMILIES["llama4_text"]["kw"])
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    hf = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                              vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    hf.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="moe_infer.checkpoint"):
        engine = moe_infer.load(tmp_path, device="cpu", dtype=torch.float32, progress=False)
    assert "the text model alone" in caplog.text and "vision_model / multi_modal_projector" in caplog.text
    # The reference: transformers' text model holding the checkpoint's language_model tensors.
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    lm = transformers.Llama4ForCausalLM(hf.config.text_config).eval()
    lm.load_state_dict({k.removeprefix("language_model."): v for k, v in saved.items()
                        if k.startswith("language_model.")})
    for p in PROMPTS:
        with torch.no_grad():
            ref = lm(torch.tensor([p])).logits[0].double()
        assert rel_err(engine.logits([p])[0, :len(p)], ref) < 1e-4
