"""Batched per-row sampling (what a decode step runs): each row draws from its own
temperature / top-k / top-p distribution, greedy rows take the argmax, and a row's draws
depend on its seed and counter alone, not on the rest of its batch."""
import pytest
import torch

from moe_infer.sampling import SamplingParams, exponential_noise, knobs, sample_rows


def reference_probs(logits, p: SamplingParams):
    """The distribution ``sample`` draws from, computed in float64."""
    x = logits.double() / p.temperature
    if p.top_k:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    s, order = x.sort(descending=True)
    probs = s.softmax(-1)
    s = s.masked_fill(probs.cumsum(-1) - probs >= p.top_p, float("-inf"))
    return torch.zeros_like(x).scatter(0, order, s.softmax(-1))


def test_each_row_follows_its_own_distribution():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 2
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, top_k=3), SamplingParams(1.3, top_p=0.6)]
    draws = 20000
    counts = torch.zeros(4, 12)
    for n in range(draws // 50):
        batch = logits.repeat(50, 1)
        ids = sample_rows(batch, [knobs(p, seed=j, counter=n) for j in range(50) for p in params]).view(50, 4)
        counts += torch.nn.functional.one_hot(ids, 12).sum(0).float()
    assert counts[1, logits[1].argmax()] == draws  # greedy: always the argmax
    for row in (0, 2, 3):
        expected = reference_probs(logits[row], params[row])
        freq = counts[row].double() / draws
        assert (freq[expected == 0] == 0).all(), row  # nothing outside top-k / top-p
        assert (freq - expected).abs().max() < 0.015, (row, freq, expected)


def test_a_seeded_row_samples_the_same_whatever_shares_its_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(1.0, top_p=0.9, seed=7)
    alone = [int(sample_rows(logits[1:2], [knobs(p, 7, n)])[0]) for n in range(20)]
    mixed = [sample_rows(logits, [knobs(SamplingParams(0.8), 3, n), knobs(p, 7, n), None]) for n in range(20)]
    assert [int(m[1]) for m in mixed] == alone and all(m[2] == logits[2].argmax() for m in mixed)
    assert len(set(alone)) > 1  # the counter moves the noise on
    other = [int(sample_rows(logits[1:2], [knobs(p, 8, n)])[0]) for n in range(20)]
    assert other != alone


def test_the_noise_is_exponential_and_seeds_are_independent():
    """The counter-based noise: mean and variance of Exp(1), no two rows alike, and the
    seeds SamplingParams accepts (up to 2**64 - 1) wrap into int64 without error."""
    noise = exponential_noise(torch.tensor([0, 1, -5]), torch.tensor([0, 0, 9]), 200_000)
    assert noise.min() > 0 and (noise.mean(1) - 1).abs().max() < 0.01 and (noise.var(1) - 1).abs().max() < 0.03
    assert torch.corrcoef(noise)[0, 1].abs() < 0.01
    for seed in (2 ** 64 - 1, -(2 ** 63)):
        assert knobs(SamplingParams(1.0, seed=seed), seed, 0)[0] in range(-(2 ** 63), 2 ** 63)


@pytest.mark.parametrize("pdl", [False, True])
def test_sampling_passes_the_kernel_options_pdl_to_its_argmax(monkeypatch, pdl):
    import kernels

    seen, real = [], kernels.argmax
    monkeypatch.setattr(kernels, "argmax", lambda x, *, pdl=True: seen.append(pdl) or real(x))
    logits = torch.randn(3, 11)
    sample_rows(logits, [None] * 3, pdl=pdl)
    sample_rows(logits, [knobs(SamplingParams(temperature=1.0), 1, 0)] * 3, pdl=pdl)
    assert seen == [pdl, pdl]
