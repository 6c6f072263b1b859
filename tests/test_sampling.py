"""Batched per-row sampling (the server's): each row draws from its own temperature / top-k
/ top-p distribution, greedy rows take the argmax, and a seeded row's draws do not depend
on the rest of its batch."""
import pytest
import torch

from moe_infer.sampling import SamplingParams, sample_rows


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
    for _ in range(draws // 50):
        batch = logits.repeat(50, 1)
        ids = sample_rows(batch, params * 50, [None] * 200).view(50, 4)
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
    alone = sample_rows(logits[1:2], [p], [torch.Generator().manual_seed(7)])
    g = torch.Generator().manual_seed(7)
    mixed = sample_rows(logits, [SamplingParams(0.8), p, SamplingParams(0.0)], [None, g, None])
    assert mixed[1] == alone[0] and mixed[2] == logits[2].argmax()
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    seq1 = [int(sample_rows(logits, [SamplingParams(1.0), p, SamplingParams(1.0)], [None, g1, None])[1])
            for _ in range(20)]
    seq2 = [int(sample_rows(logits[1:2], [p], [g2])[0]) for _ in range(20)]
    assert seq1 == seq2


@pytest.mark.parametrize("pdl", [False, True])
def test_sampling_passes_the_kernel_options_pdl_to_its_argmax(monkeypatch, pdl):
    import kernels

    from moe_infer.sampling import sample

    seen, real = [], kernels.argmax
    monkeypatch.setattr(kernels, "argmax", lambda x, *, pdl=True: seen.append(pdl) or real(x))
    logits = torch.randn(3, 11)
    sample(logits, SamplingParams(), pdl=pdl)
    sample_rows(logits, [SamplingParams(temperature=1.0, seed=1)] * 3, [None] * 3, pdl=pdl)
    assert seen == [pdl, pdl]
