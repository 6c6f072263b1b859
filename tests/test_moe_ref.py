"""The four MoE steps: each against a brute-force formulation, on awkward shapes."""
import pytest
import torch

import kernels
from kernels import (fused_moe, gather_rows_ref, grouped_ffn_ref, scatter_rows_ref,
                     token_maps_ref, topk_gating_ref)


def loop_moe(x, w13, w2, weights, ids, activation):
    """Hugging Face eager style: every token, every slot, one expert at a time, float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = kernels.expert_ffn_ref(x[t:t + 1].double(), w13[e].double(), w2[e].double(), activation)
            out[t] += weights[t, j].double() * y[0]
    return out


@pytest.mark.parametrize("t,e,k", [(1, 4, 1), (3, 5, 2), (33, 7, 3), (130, 8, 8)])
def test_token_maps_group_by_expert_in_token_order(t, e, k):
    torch.manual_seed(t)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    offsets, rows = token_maps_ref(ids, e)
    counts = torch.bincount(ids.flatten().long(), minlength=e)
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()
    assert sorted(rows.flatten().tolist()) == list(range(t * k))  # a permutation
    for ex in range(e):
        mine = rows[ids == ex]  # (token, slot) pairs of this expert, in token order
        assert mine.tolist() == list(range(offsets[ex], offsets[ex + 1]))


def test_token_maps_capacity_drops_late_tokens():
    ids = torch.tensor([[0], [0], [1], [0], [0]], dtype=torch.int32)
    offsets, rows = token_maps_ref(ids, 2, capacity=2)
    assert offsets.tolist() == [0, 2, 3]
    assert rows.flatten().tolist() == [0, 1, 2, -1, -1]


@pytest.mark.parametrize("t,h,k", [(1, 7, 1), (5, 33, 2), (17, 130, 4)])
def test_scatter_then_gather_with_unit_weights_restores_input(t, h, k):
    torch.manual_seed(h)
    e = 6
    x = torch.randn(t, h)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).int()
    _, rows = token_maps_ref(ids, e)
    xs = scatter_rows_ref(x, rows)
    back = gather_rows_ref(xs, rows, torch.full((t, k), 1.0 / k))
    torch.testing.assert_close(back, x)
    # Rows of -1 add nothing, also when no row was kept (an expert-parallel rank that sent nothing).
    dropped = torch.where(rows % 2 == 0, rows, -1)
    expected = sum(torch.where(dropped[:, j, None] >= 0, xs[dropped[:, j].clamp(min=0).long()], 0) for j in range(k))
    torch.testing.assert_close(gather_rows_ref(xs, dropped, torch.ones(t, k)), expected)
    assert gather_rows_ref(xs[:0], torch.full_like(rows, -1), torch.ones(t, k)).equal(torch.zeros(t, h))


@pytest.mark.parametrize("score,renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_topk_gating_matches_dense_scores(score, renorm):
    torch.manual_seed(0)
    logits = torch.randn(9, 7)
    ids, w = topk_gating_ref(logits, 3, score, renorm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    picked = scores.gather(1, ids.long())
    assert (picked.min(1).values[:, None] >= scores.masked_fill(
        torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids.long(), True), -1)).all()
    expect = picked / picked.sum(-1, keepdim=True) if renorm else picked
    torch.testing.assert_close(w, expect)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("t,h,f,e,k", [(1, 31, 12, 4, 2), (3, 48, 20, 5, 1), (33, 24, 16, 9, 3)])
def test_fused_moe_ref_matches_per_token_loop(activation, t, h, f, e, k):
    torch.manual_seed(t * h)
    rows13 = 2 * f if activation == "silu" else f
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, rows13, h) / h ** 0.5, torch.randn(e, h, f) / f ** 0.5
    ids, weights = topk_gating_ref(torch.randn(t, e), k)
    out = fused_moe(x, w13, w2, weights, ids, activation)
    torch.testing.assert_close(out.double(), loop_moe(x, w13, w2, weights, ids, activation),
                               rtol=1e-5, atol=1e-5)


def test_grouped_ffn_skips_experts_without_rows():
    torch.manual_seed(1)
    xs = torch.randn(4, 8)
    offsets = torch.tensor([0, 0, 4, 4], dtype=torch.int32)  # only expert 1 has rows
    w13, w2 = torch.randn(3, 10, 8), torch.randn(3, 8, 5)
    w13[0] = float("nan")  # would poison the result if expert 0 ran
    ys = grouped_ffn_ref(xs, offsets, w13, w2)
    torch.testing.assert_close(ys, kernels.expert_ffn_ref(xs, w13[1], w2[1]))


@pytest.mark.parametrize("bad,match", [
    (dict(activation="relu"), "activation"),
    (dict(x=torch.randn(2, 3, 8)), "x: expected"),
    (dict(w2=torch.randn(4, 9, 6)), "w13"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int32)), "topk_ids"),
    (dict(topk_ids=torch.zeros(2, 2)), "int32 or int64"),
])
def test_fused_moe_rejects_bad_arguments(bad, match):
    args = dict(x=torch.randn(2, 8), w13=torch.randn(4, 12, 8), w2=torch.randn(4, 8, 6),
                topk_weights=torch.rand(2, 2), topk_ids=torch.zeros(2, 2, dtype=torch.int32),
                activation="silu")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)
