"""Scaled rotary positions (linear, dynamic NTK, YaRN, Llama 3, LongRoPE) against
transformers: the frequencies, the logits of prompts past the original context, and
greedy generation with a KV cache (whose keys keep the frequencies they were written
with, as transformers' cache keeps them), in float32 on the CPU."""
import copy

import pytest
import torch

import moe_infer
from hf_models import save_hf_model
from moe_infer.config import ConfigError
from parity import rel_err

HALF = 5  # qwen3_moe's head_dim 10 in hf_models: five frequencies
SCALINGS = {
    "linear": dict(rope_type="linear", factor=3.0),
    "dynamic": dict(rope_type="dynamic", factor=2.5),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=0.9,
                        mscale_all_dim=0.5, beta_fast=16.0, beta_slow=2.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8),
    "longrope": dict(rope_type="longrope", factor=2.0, original_max_position_embeddings=8,
                     short_factor=[1.0, 1.1, 1.3, 1.6, 2.0], long_factor=[1.5, 2.5, 4.0, 6.0, 9.0]),
}
MAX_POSITION = 16  # the dynamic kind scales past it, the others' original context is 8


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model("qwen3_moe", path, rope=SCALINGS[request.param], max_position_embeddings=MAX_POSITION,
                       rope_theta=50.0)
    return request.param, path, hf


def test_frequencies_equal_transformers(scaled):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    name, path, hf = scaled
    rotary = moe_infer.load(path, device="cpu", progress=False).model.rotary
    kind = SCALINGS[name]["rope_type"]
    for longest in (4, 12, 40):
        want, factor = ROPE_INIT_FUNCTIONS[kind](hf.config, "cpu", seq_len=torch.tensor(longest))
        got = rotary.inv_freq("cpu", torch.tensor(longest))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert rotary.attention_factor == pytest.approx(factor)


def test_logits_and_cached_greedy_generation_match_transformers(scaled):
    name, path, hf = scaled
    engine = moe_infer.load(path, device="cpu", progress=False, dtype=torch.float32)
    engine.config.engine.max_seq_len = 64  # past max_position_embeddings (a config allows it for dynamic scaling)
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(0, 99, (n,), generator=gen).tolist() for n in (6, 13, 21)]
    for p in prompts:  # one forward, across the original context and past max_position
        with torch.no_grad():
            ref = copy.deepcopy(hf)(torch.tensor([p])).logits[0]
        assert rel_err(engine.logits([p])[0, :len(p)], ref) < 1e-4, (name, len(p))
    for p in prompts:  # prefill, then decode steps that cross the thresholds one token at a time
        want = cached_greedy(hf, p, 8)
        for mode in ("eager", "static"):  # the fixed-shape step (a CUDA graph's math) too
            engine.decode_mode = mode
            assert engine.generate([p], max_new_tokens=8)[0].token_ids == want, (name, len(p), mode)


def cached_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' model with its KV cache: the whole prompt in one forward, then one token
    a forward (its generate() prefills all but the last prompt token first, which moves the
    dynamic kinds' frequencies: the forwards are the definition)."""
    from transformers import DynamicCache

    model = copy.deepcopy(hf)  # (its dynamic frequencies keep state between calls)
    cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            start = len(prompt) + len(out) - ids.shape[1]
            logits = model(ids, past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(start, start + ids.shape[1])[None]).logits
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def test_unknown_or_incomplete_scaling_is_refused_with_its_key(tmp_path):
    import json

    save_hf_model("qwen3_moe", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for rope, match in ((dict(rope_type="su", factor=2.0), r"rope_type='su'"),
                        (dict(rope_type="llama3", factor=8.0), r"low_freq_factor=None: expected a value"),
                        (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=8, alpha=1.0),
                         r"rope parameter 'alpha'"),
                        (dict(rope_type="longrope", original_max_position_embeddings=8, short_factor=[1.0],
                              long_factor=[1.0] * HALF), r"short_factor=\[1\.0\]: expected 5 numbers"),
                        (dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5),
                         r"partial_rotary_factor=0\.5")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_theta": 1e4, **rope}}))
        with pytest.raises(ConfigError, match=match):
            moe_infer.load(tmp_path, device="cpu", progress=False)


def test_a_model_yaml_names_its_scaling_and_a_wrong_key_is_named(tmp_path):
    import dataclasses

    import yaml

    from moe_infer.config_files import config_from_dict, load_preset

    base = load_preset("tiny-moe")
    model = {k: v for k, v in dataclasses.asdict(base.model).items() if v not in (None, ())}
    model["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    cfg = config_from_dict({"model": model})
    assert cfg.model.rope_scaling.rope_type == "yarn" and cfg.model.rope_scaling.factor == 4.0
    (tmp_path / "m.yaml").write_text(yaml.safe_dump({"model": model, "moe": dataclasses.asdict(base.moe)}))
    assert moe_infer.load(str(tmp_path / "m.yaml"), device="cpu", progress=False).model.rotary.attention_factor > 1
    model["rope_scaling"] = {"rope_type": "yarn", "factr": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ConfigError, match=r"model\.rope_scaling\.factr=4\.0: unknown key \(did you mean 'factor'\?\)"):
        config_from_dict({"model": model})


def test_only_dynamic_scaling_lets_the_engine_run_past_max_position():
    import dataclasses

    from moe_infer.config_files import config_from_dict, load_preset

    base = load_preset("tiny-moe")
    model = {k: v for k, v in dataclasses.asdict(base.model).items() if v not in (None, ())}
    moe = dataclasses.asdict(base.moe)
    longer = {"max_seq_len": 2 * base.model.max_position}
    model["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    assert config_from_dict({"model": model, "moe": moe, "engine": longer}).max_seq_len == longer["max_seq_len"]
    model["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match=r"engine\.max_seq_len=.*: expected at most model\.max_position"):
        config_from_dict({"model": model, "moe": moe, "engine": longer})


def test_latent_attention_takes_yarn_with_its_softmax_scale(tmp_path):
    """DeepSeek-V3 (latent attention, interleaved rotary pairs) under YaRN with
    mscale_all_dim, which also scales the softmax (by mscale squared): logits and cached
    greedy generation, eager and fixed-shape, against transformers."""
    hf = save_hf_model("deepseek_v3", tmp_path, rope=SCALINGS["yarn-mscale"], max_position_embeddings=MAX_POSITION,
                       rope_theta=50.0)
    engine = moe_infer.load(tmp_path, device="cpu", progress=False, dtype=torch.float32)
    assert engine.model.layers[0].attn.scale != pytest.approx(20 ** -0.5)
    p = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2)).tolist()  # past the original 8
    with torch.no_grad():
        ref = copy.deepcopy(hf)(torch.tensor([p])).logits[0]
    assert rel_err(engine.logits([p])[0, :len(p)], ref) < 1e-4
    want = cached_greedy(hf, p, 6)
    for mode in ("eager", "static"):
        engine.decode_mode = mode
        assert engine.generate([p], max_new_tokens=6)[0].token_ids == want, mode


def test_pairs_to_halves_turns_the_interleaved_rotation_into_the_halves_one():
    """Rows read with pairs_to_halves, rotated as halves, are the interleaved rotation's
    rows reordered alike (Llama 4, DeepSeek): in every head, only its rotary rows move."""
    from dense.rotary import apply_rotary_all, pairs_to_halves

    gen = torch.Generator().manual_seed(0)
    nope, rope, heads = 3, 8, 2
    rows = torch.randn(heads * (nope + rope), 5, generator=gen)
    theta = torch.rand(rope // 2, generator=gen) * 3
    c, s = theta.cos(), theta.sin()

    def interleaved(v):  # [heads, nope + rope]: pairs (2i, 2i + 1) turn by theta_i
        out = v.clone()
        a, b = v[:, nope::2], v[:, nope + 1::2]
        out[:, nope::2], out[:, nope + 1::2] = a * c - b * s, a * s + b * c
        return out

    x = torch.randn(5, generator=gen)
    want = pairs_to_halves(interleaved((rows @ x).view(heads, -1)).reshape(-1, 1), nope + rope, nope, rope)
    got = (pairs_to_halves(rows, nope + rope, nope, rope) @ x).view(heads, -1)
    got[:, nope:] = apply_rotary_all(got[:, nope:], torch.cat([c, c]), torch.cat([s, s]))
    torch.testing.assert_close(got.reshape(-1, 1), want)
    assert torch.equal(pairs_to_halves(rows, nope + rope, nope, rope).view(heads, -1, 5)[:, :nope],
                       rows.view(heads, -1, 5)[:, :nope])
