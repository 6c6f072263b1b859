"""Routing (``kernels.routing``): the Triton top-k gating kernels, and gating with the maps in
one launch (``route_triton``), against their plain-torch references (kernels/routing/reference.py).

On CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1), at
~1.5 ms a program plus the cost of the tile, so the shape lists below are picked, not a grid.
ids are compared exactly, so the logits are drawn with no near-ties: rows whose reference
decisions (order of the top k + 1 scores, the kept-group boundary) are closer than MARGIN are
re-drawn. Two correct float32 implementations differ by ~1e-7; torch.topk on CPU does not
even break exact ties by index at E = 256, so exact ties must not reach the comparison.
"""
import pytest
import torch

from kernels.layout.reference import row_pair_ref, token_maps_ref
from kernels.routing.gating import grouped_topk_triton, topk_gating_triton
from kernels.routing.reference import grouped_topk_ref, topk_gating_ref
from kernels.routing.route_triton import route_triton
from tests.kernels.common import CPU, GPU

MARGIN = 1e-5
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DEVICES = [pytest.param("cpu", marks=pytest.mark.interp), pytest.param("cuda", marks=pytest.mark.gpu)]


def _scores(logits, score):
    logits = logits.float()
    return logits.softmax(-1) if score == "softmax" else logits.sigmoid()  # [T, E]


def _order_gap(values, n):
    """Smallest gap between consecutive values among each row's n largest: [T] (gaps
    between two -inf, and rows with n = 1, count as inf)."""
    top = values.topk(n, dim=-1).values  # [T, n]
    gaps = top[:, :-1] - top[:, 1:]
    gaps = torch.where(torch.isfinite(gaps), gaps, torch.full_like(gaps, float("inf")))
    return torch.cat([gaps, torch.full_like(top[:, :1], float("inf"))], dim=1).amin(-1)


def _topk_margin(logits, k, score):
    return _order_gap(_scores(logits, score), min(k + 1, logits.shape[1]))  # [T]


def _grouped_margin(logits, bias, k, n_group, topk_group, score, group_max=False):
    t, e = logits.shape
    choice = (_scores(logits, score) + bias.float()).view(t, n_group, e // n_group)
    group_score = choice.topk(1 if group_max else min(2, e // n_group), dim=-1).values.sum(-1)  # [T, G]
    # Only the boundary between the last kept and the first dropped group decides anything.
    ranked = group_score.sort(dim=-1, descending=True).values
    margin = (ranked[:, topk_group - 1] - ranked[:, topk_group] if topk_group < n_group
              else torch.full((t,), float("inf")))
    dropped = ranked.new_ones(t, n_group, dtype=torch.bool).scatter_(
        1, group_score.topk(topk_group, dim=-1).indices, False)
    choice = choice.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, e)
    n = min(k + 1, topk_group * (e // n_group))
    return torch.minimum(margin, _order_gap(choice, n))  # [T]


def _draw_logits(t, e, dtype, seed, margin_fn):
    """t rows of logits in dtype whose reference decisions all have a gap of MARGIN."""
    gen = torch.Generator().manual_seed(seed)
    pool = (2 * torch.randn(8 * t + 16, e, generator=gen)).to(dtype)
    safe = pool[margin_fn(pool) > MARGIN]
    assert safe.shape[0] >= t, "too few rows without near-ties: widen the pool"
    return safe[:t]


TOPK_CASES = [  # t, e, k, score, renormalize, dtype
    (1, 6, 1, "softmax", True, F32),
    (1, 256, 8, "sigmoid", True, BF16),
    (3, 6, 2, "sigmoid", False, F16),
    (3, 60, 8, "softmax", True, BF16),
    (3, 128, 2, "sigmoid", True, F16),
    (33, 8, 8, "softmax", False, F32),  # k == E
    (33, 60, 2, "sigmoid", True, F32),
    (33, 128, 1, "softmax", False, F16),
    (33, 256, 2, "softmax", True, F16),
    (130, 8, 2, "softmax", True, BF16),
    (130, 60, 1, "sigmoid", False, F32),
    (130, 128, 8, "sigmoid", False, BF16),
    (130, 256, 8, "softmax", True, F32),
    (3, 1000, 8, "softmax", True, F32),  # past 256: 4 rows a program
    (33, 60, 8, "sigmoid", True, torch.float64),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,k,score,renorm,dtype", TOPK_CASES)
def test_topk_gating_triton_matches_ref(device, t, e, k, score, renorm, dtype):
    logits = _draw_logits(t, e, dtype, seed=t * 1000 + e + k,
                          margin_fn=lambda x: _topk_margin(x, k, score)).to(device)
    ids, weights = topk_gating_triton(logits, k, score, renorm)
    ref_ids, ref_weights = topk_gating_ref(logits, k, score, renorm)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (t, k)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_gating_triton_strided_and_empty(device):
    # A transposed view: stride along E is T, not 1.
    logits = _draw_logits(33, 60, F32, seed=7, margin_fn=lambda x: _topk_margin(x, 2, "softmax"))
    strided = logits.t().contiguous().to(device).t()  # [T, E], strides (1, T)
    ids, weights = topk_gating_triton(strided, 2)
    ref_ids, ref_weights = topk_gating_ref(strided, 2)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights)
    ids, weights = topk_gating_triton(torch.empty(0, 8, device=device), 2)
    assert ids.shape == weights.shape == (0, 2)


TIE_CASES = [  # t, e, k, score, renormalize, dtype
    (1, 64, 8, "softmax", False, BF16),
    (1, 128, 8, "softmax", True, BF16),
    (3, 6, 2, "sigmoid", True, F16),
    (33, 256, 8, "softmax", True, F16),
    (5, 60, 4, "sigmoid", False, BF16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,k,score,renorm,dtype", TIE_CASES)
def test_16bit_logits_break_exact_ties_by_index(device, t, e, k, score, renorm, dtype):
    """bf16 / fp16 logits take the integer-key rounds (``_topk_keys``): with values from a
    small set (exact ties everywhere, -0 beside +0, negatives) the winners are the k largest
    with ties to the lower expert index (a stable descending sort), the weights those
    experts' scores."""
    gen = torch.Generator().manual_seed(t * 100 + e + k)
    values = torch.tensor([-2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0])
    logits = values[torch.randint(0, len(values), (t, e), generator=gen)].to(dtype)
    ids, weights = topk_gating_triton(logits.to(device), k, score, renorm)
    x = logits.float()
    want = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    scores = _scores(logits, score).gather(1, want)
    if renorm:
        scores = scores / scores.sum(-1, keepdim=True)
    assert torch.equal(ids.cpu().long(), want)
    torch.testing.assert_close(weights.cpu(), scores)


GROUPED_CASES = [  # t, e, n_group, topk_group, k, score, renormalize, scale, dtype
    (1, 64, 8, 3, 6, "sigmoid", True, 2.5, F32),
    (33, 64, 8, 3, 6, "sigmoid", False, 1.0, BF16),
    (130, 64, 8, 3, 6, "softmax", True, 1.0, F16),
    (3, 256, 8, 4, 8, "sigmoid", True, 2.5, BF16),
    (33, 256, 8, 4, 8, "softmax", False, 1.0, F32),
    (130, 256, 8, 4, 8, "sigmoid", True, 2.5, F32),
    (33, 60, 4, 2, 4, "sigmoid", True, 1.0, F32),  # groups of 15: each padded to 16
    (3, 8, 8, 3, 2, "sigmoid", True, 1.0, F32),  # groups of one expert
    (33, 128, 1, 1, 8, "sigmoid", True, 1.0, F16),  # one group: plain top-k of the choice
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,n_group,topk_group,k,score,renorm,scale,dtype", GROUPED_CASES)
def test_grouped_topk_triton_matches_ref(device, t, e, n_group, topk_group, k, score, renorm,
                                         scale, dtype):
    gen = torch.Generator().manual_seed(e + k)
    # Of the order of the score spread, so the bias really reorders experts and groups.
    bias = 0.3 * torch.randn(e, generator=gen)
    logits = _draw_logits(t, e, dtype, seed=t * 1000 + e, margin_fn=lambda x: _grouped_margin(
        x, bias, k, n_group, topk_group, score))
    logits, bias = logits.to(device), bias.to(device)
    args = (k, n_group, topk_group, score, renorm, scale)
    ids, weights = grouped_topk_triton(logits, bias, *args)
    ref_ids, ref_weights = grouped_topk_ref(logits, bias, *args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (t, k)
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,n_group,topk_group,k", [(1, 64, 8, 3, 6), (33, 160, 8, 3, 6), (7, 60, 4, 2, 4)])
def test_group_limited_greedy_triton_matches_ref(device, t, e, n_group, topk_group, k):
    """DeepSeek-V2's routing: softmax scores, each group scored by its best expert, the
    weights scaled, not renormalised."""
    logits = _draw_logits(t, e, F32, seed=t + e, margin_fn=lambda x: _grouped_margin(
        x, torch.zeros(e), k, n_group, topk_group, "softmax", group_max=True))
    args = (k, n_group, topk_group, "softmax", False, 16.0)
    bias = torch.zeros(e, device=device)
    ids, weights = grouped_topk_triton(logits.to(device), bias, *args, group_max=True)
    ref_ids, ref_weights = grouped_topk_ref(logits, bias.cpu(), *args, group_max=True)
    torch.testing.assert_close(ids.cpu(), ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights.cpu(), ref_weights)
    # By hand: a group whose best expert leads but whose second is poor beats a group of two
    # good ones under group_max, and loses to it under the V3 sum.
    row = torch.log(torch.tensor([[0.40, 0.01, 0.25, 0.24, 0.05, 0.05]]))
    one = grouped_topk_ref(row, torch.zeros(6), 1, 3, 1, "softmax", False, group_max=True)[0]
    two = grouped_topk_ref(row, torch.zeros(6), 1, 3, 1, "softmax", False)[0]
    assert one.tolist() == [[0]] and two.tolist() == [[2]]


def test_grouped_topk_ref_by_hand():
    # 4 groups of 2 experts, topk_group=2, k=2. Group sums of the choice: 0.92, 0.95, 0.3,
    # 1.0, so groups 3 and 1 stay and expert 0, the best single choice, is out. Expert 7
    # scores 0.9 but its bias of -0.5 leaves it behind experts 6 and 2.
    choice = torch.tensor([[0.9, 0.02, 0.5, 0.45, 0.1, 0.2, 0.6, 0.4]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.5])
    scores = choice - bias  # the unbiased scores the weights come from
    ids, weights = grouped_topk_ref(torch.logit(scores), bias, 2, 4, 2, renormalize=False,
                                    routed_scaling_factor=2.0)
    assert ids.tolist() == [[6, 2]]
    torch.testing.assert_close(weights, 2.0 * scores[:, [6, 2]])


def test_grouped_topk_ref_masks_dropped_groups_with_minus_inf():
    # A negative bias pushes every kept choice below 0; a 0 fill would pick dropped experts.
    logits = torch.tensor([[4.0, 3.0, -4.0, -3.0]])
    bias = torch.full((4,), -2.0)
    ids, _ = grouped_topk_ref(logits, bias, 2, 2, 1)
    assert ids.tolist() == [[0, 1]]


def test_grouped_topk_ref_with_one_group_and_no_bias_is_plain_topk():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    ids, weights = grouped_topk_ref(logits, torch.zeros(16), 4, 1, 1, score="softmax",
                                    routed_scaling_factor=1.5)
    ref_ids, ref_weights = topk_gating_ref(logits, 4, "softmax")
    torch.testing.assert_close(ids, ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights, 1.5 * ref_weights)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,k,shared,dtype", [(1, 64, 6, 2, BF16), (5, 9, 3, 1, F32), (33, 60, 4, 3, F16)])
def test_shared_slots_follow_the_top_k(device, t, e, k, shared, dtype):
    """``shared`` = n: each row's table is the top-k, then ids E .. E + n - 1 with weight 1
    (shared experts held after the routed ones), from the plain and the grouped kernels alike."""
    logits = _draw_logits(t, e, dtype, seed=t + e + shared, margin_fn=lambda x: _topk_margin(x, k, "softmax"))
    logits = logits.to(device)
    ids, weights = topk_gating_triton(logits, k, "softmax", True, shared=shared)
    ref_ids, ref_weights = topk_gating_ref(logits, k, "softmax", True)
    assert ids.shape == weights.shape == (t, k + shared)
    torch.testing.assert_close(ids[:, :k], ref_ids, rtol=0, atol=0)
    torch.testing.assert_close(weights[:, :k], ref_weights)
    fixed = torch.arange(e, e + shared, dtype=torch.int32, device=device).expand(t, shared)
    torch.testing.assert_close(ids[:, k:], fixed, rtol=0, atol=0)
    assert (weights[:, k:] == 1).all()
    ref = topk_gating_ref(logits, k, "softmax", True, shared=shared)
    torch.testing.assert_close(ids, ref[0], rtol=0, atol=0)
    torch.testing.assert_close(weights, ref[1])
    # grouped: one group of all experts and no bias is the plain top-k, times the scale
    bias = torch.zeros(e, device=device)
    ids, weights = grouped_topk_triton(logits, bias, k, 1, 1, "softmax", True, 1.5, shared=shared)
    torch.testing.assert_close(ids, torch.cat([ref_ids, fixed], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(weights, torch.cat([1.5 * ref_weights, weights.new_ones(t, shared)], dim=1))
    ref = grouped_topk_ref(logits, bias, k, 1, 1, "softmax", True, 1.5, shared=shared)
    torch.testing.assert_close(ids, ref[0], rtol=0, atol=0)
    torch.testing.assert_close(weights, ref[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(shared=-1), "shared=-1"),
    (dict(shared=1.0), "shared=1.0"),
    (dict(k=9), "k=9"),  # k > E
    (dict(k=0), "k=0"),
    (dict(k=2.0), "k=2.0"),
    (dict(logits=torch.randn(8)), r"logits: expected \[T, E\]"),
    (dict(logits=torch.randn(2, 3, 8)), r"logits: expected \[T, E\]"),
    (dict(logits=torch.ones(3, 8, dtype=torch.int32)), "logits: expected one of"),
    (dict(logits=torch.randn(3, 2048)), "E=2048"),
    (dict(score="relu"), "score='relu'"),
])
def test_topk_gating_triton_rejects_bad_arguments(kwargs, match):
    args = dict(logits=torch.randn(3, 8), k=2, score="softmax")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        topk_gating_triton(**args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_group=5), "topk_group=5"),  # > n_group
    (dict(n_group=3), "n_group=3"),  # 64 experts do not split into 3 groups
    (dict(k=17), "k=17"),  # more than the 2 kept groups of 8 hold
    (dict(k=65), "k=65"),  # k > E
    (dict(bias=torch.zeros(63)), r"bias: expected \[E=64\]"),
    (dict(bias=torch.zeros(64, dtype=torch.int64)), "bias: expected a float dtype"),
    (dict(logits=torch.randn(64)), r"logits: expected \[T, E\]"),
    (dict(score="tanh"), "score='tanh'"),
])
def test_grouped_topk_triton_rejects_bad_arguments(kwargs, match):
    args = dict(logits=torch.randn(3, 64), bias=torch.zeros(64), k=4, n_group=4, topk_group=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        grouped_topk_triton(**args)


@pytest.mark.interp
def test_checks_still_refuse_after_a_good_call():
    """A (shape, dtype, k, score) checked once is not checked again; a bool or float k equal
    to a seen k, or another score, must still be refused."""
    logits = torch.randn(3, 8)
    topk_gating_triton(logits, 1)
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="expected an int"):
            topk_gating_triton(logits, bad)
    with pytest.raises(ValueError, match="score="):
        topk_gating_triton(logits, 1, "top1")


@pytest.mark.gpu
def test_gating_through_the_cached_launcher():
    """After the first call the gating launch skips the JIT (kernels.launcher): new logits,
    a strided unaligned view (a new key), bf16 logits, each equal the reference; repeated
    keys add no cache entries."""
    from kernels.routing import gating

    e, k = 64, 6
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(5, 2 * e + 3, generator=gen).cuda()
    cases = [torch.randn(3, e, generator=gen).cuda(), torch.randn(3, e, generator=gen).cuda(), wide[1:4, 1:1 + e],
             wide[0:3, 4:4 + e], torch.randn(3, e, generator=gen).bfloat16().cuda()]  # [2], [3]: 16-byte aligned
    sizes = []
    for logits in cases:
        ids, w = topk_gating_triton(logits, k)
        ref_ids, ref_w = topk_gating_ref(logits.cpu().float(), k)
        assert ids.is_contiguous() and w.is_contiguous() and w.dtype == F32 and ids.shape == (3, k)
        assert torch.equal(ids.cpu(), ref_ids.to(ids.dtype))
        torch.testing.assert_close(w.cpu(), ref_w)
        sizes.append(len(gating._gating.cache))
    assert sizes[1] == sizes[0] and sizes[3] == sizes[2] and sizes[4] == sizes[3] + 1, sizes


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t,e,k,score", [(1, 8, 2, "softmax"), (3, 60, 4, "sigmoid"), (16, 128, 8, "softmax"),
                                         (5, 7, 3, "softmax"), (40, 64, 8, "softmax")])
def test_route_matches_gating_then_maps(device, t, e, k, score):
    """Gating and maps in one launch (or two, past the one-program size) equal the two
    references run one after the other."""
    gen = torch.Generator().manual_seed(t * e)
    logits = torch.randn(t, e, generator=gen)
    ids, w, (offsets, rows, row_pair) = route_triton(logits.to(device), k, score)
    ref_ids, ref_w = topk_gating_ref(logits, k, score)
    ref_offsets, ref_rows = token_maps_ref(ref_ids, e)
    assert torch.equal(ids.cpu(), ref_ids) and torch.equal(offsets.cpu(), ref_offsets)
    assert torch.equal(rows.cpu(), ref_rows)
    torch.testing.assert_close(w.cpu(), ref_w)
    assert torch.equal(row_pair.cpu(), row_pair_ref(ref_rows))


@pytest.mark.interp
def test_route_checks_still_refuse_after_a_good_call():
    """The one-launch path skips its checks for a (shape, dtype, k, score) seen before; a
    bool or float k equal to a seen k must still be refused."""
    logits = torch.randn(2, 8)
    route_triton(logits, 1)
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="expected an int"):
            route_triton(logits, bad)
    with pytest.raises(ValueError, match="score="):
        route_triton(logits, 1, "top1")


@pytest.mark.gpu
def test_route_through_the_cached_launcher():
    """After the first call the one-launch routing skips the JIT (kernels.launcher): new
    logits, then logits that are a strided, unaligned view (a new key: another compile),
    each equal the references, and repeated keys add no cache entries."""
    import kernels.routing.route_triton as route_mod

    e, k = 64, 8
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(4, 3 * e + 1, generator=gen).cuda()
    cases = [torch.randn(2, e, generator=gen).cuda(), torch.randn(2, e, generator=gen).cuda(), wide[1:3, 1:1 + e],
             wide[0:2, 2:2 + e], torch.randn(2, e, generator=gen).bfloat16().cuda()]  # [3]: [2]'s offset mod 16
    sizes = []
    for logits in cases:
        ids, w, (offsets, rows, row_pair) = route_triton(logits, k)
        ref_ids, ref_w = topk_gating_ref(logits.cpu().float(), k)
        ref_offsets, ref_rows = token_maps_ref(ref_ids, e)
        assert torch.equal(ids.cpu(), ref_ids) and torch.equal(offsets.cpu(), ref_offsets)
        assert torch.equal(rows.cpu(), ref_rows) and torch.equal(row_pair.cpu(), row_pair_ref(ref_rows))
        torch.testing.assert_close(w.cpu(), ref_w)
        sizes.append(len(route_mod._route.cache))
    assert sizes[1] == sizes[0] and sizes[3] == sizes[2] and sizes[4] == sizes[3] + 1, sizes


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,k,e,ids_dtype,first,way", [(1, 8, 128, torch.int32, 0, 4), (5, 8, 64, torch.int64, 0, 3),
                                                       (16, 8, 40, torch.int32, 6, None),
                                                       (70, 8, 128, torch.int64, 32, 4),
                                                       (512, 6, 1000, torch.int32, 0, 3),
                                                       (700, 8, 64, torch.int64, 8, None)])
def test_cold_pairs_triton_matches_ref(device, t, k, e, ids_dtype, first, way):
    """An offloaded layer's split of its pairs in one launch: each pair's device slot, the
    cold pairs' experts, the experts' routed counts and the counters (pairs, cold pairs,
    distinct cold experts met, the way or none) against the torch reference, with experts
    repeated within and across tokens, within one block of pairs and past several; ids
    counted from an offset, some of experts that are not here (expert parallelism: slot
    -2, counted nowhere); prompts' calls, whose pairs several programs share (3072 pairs
    over 1000 experts, not a power of two, fewer pairs a block; 5600 over 64); a second
    call adds to the counters and meets scratch sums left at zero by the first."""
    from kernels.routing.cold_triton import cold_pairs_triton
    from kernels.routing.reference import cold_pairs_ref

    gen = torch.Generator().manual_seed(t * e)
    ids = torch.randint(0, e + 2 * first, (t, k), generator=gen).to(device, ids_dtype)
    table = torch.full((e,), -1, dtype=torch.int64)
    hot = torch.randperm(e, generator=gen)[: e // 3]
    table[hot] = torch.arange(len(hot))
    table = table.to(device)
    got_r, want_r = (torch.rand(e, generator=gen).to(device) for _ in range(2))
    want_r.copy_(got_r)
    got_t, want_t = (torch.arange(5, dtype=torch.float64, device=device) for _ in range(2))
    for _ in range(2):
        slot, cold, met = cold_pairs_triton(ids, table, got_r, got_t, way, first)
        want_slot, want_cold, want_met = cold_pairs_ref(ids, table, want_r, want_t, way, first)
        assert slot.dtype == cold.dtype == torch.int64 and slot.shape == cold.shape == (t, k)
        assert torch.equal(slot, want_slot) and torch.equal(cold, want_cold) and torch.equal(met, want_met)
        assert torch.allclose(got_r, want_r) and torch.equal(got_t, want_t)
    assert want_t[2] > 0 and (t == 1 or want_t[1] > want_t[2])  # some cold experts; past one token, some met twice
    assert (first == 0) == bool((want_slot > -2).all())  # with an offset, some pairs are not here


def test_cold_pairs_rejects_bad_operands():
    from kernels import cold_pairs

    ids, table = torch.zeros(2, 4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    routed, tally = torch.zeros(8), torch.zeros(5, dtype=torch.float64)
    with pytest.raises(ValueError, match="int64 table"):
        cold_pairs(ids.float(), table, routed, tally, 4)
    with pytest.raises(ValueError, match="3 <= way"):
        cold_pairs(ids, table, routed, tally, 2)
    with pytest.raises(ValueError, match="float32 \\[E\\]"):
        cold_pairs(ids, table, torch.zeros(7), tally, 4)


_COMPILE_COLD = """
import sys
from kernels.routing.cold_triton import _cold_pairs_kernel as kernel

pdl, ids = int(sys.argv[1]), sys.argv[2]
const = dict(WAY=4 if pdl else -1, BLOCK=64, E_PAD=256, SPAN=1024, PDL=pdl)
types = {"ids_ptr": ids, "table_ptr": "*i64", "routed_ptr": "*fp32", "tally_ptr": "*fp64", "slot_ptr": "*i64",
         "cold_ptr": "*i64", "met_ptr": "*i32", "scratch_ptr": "*i32", "P": "i32", "E": "i32", "first": "i32"}
"""


@pytest.mark.parametrize("pdl, ids", [(0, "*i32"), (2, "*i64")])
def test_cold_pairs_compiles_for_hopper(pdl, ids):
    """The offload split's whole Triton compile for sm_90 (tests.hopper): float64 counters,
    float32 and int32 atomics and the ticket, int32 or int64 ids, with PDL and a way
    counted, and without either."""
    from tests.hopper import compile_kernel

    assert compile_kernel(_COMPILE_COLD, pdl, ids) > 0
