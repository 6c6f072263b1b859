"""The layout ops between token order and the expert-major buffer (``kernels.layout``): the
Triton maps, scatter, gather and expert-parallel dispatch against their references, on CPU
under the interpreter and on a GPU; the references against brute-force formulations."""
import pytest
import torch

from kernels.layout.maps import token_maps_triton
from kernels.layout.reference import TAG_INTS, dispatch_rows_ref, gather_rows_ref, scatter_rows_ref, token_maps_ref
from kernels.layout.rows import dispatch_rows_triton, gather_rows_triton, scatter_rows_triton
from tests.kernels.common import CPU, GPU, rel, routing

# The gather's weighted sums round to the dtype (float32 accumulation).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t,e,k,cap", [(1, 8, 2, None), (3, 5, 2, None), (33, 7, 3, None), (60, 6, 2, 4),
                                       (511, 60, 4, None), (700, 9, 3, 100), (2100, 12, 4, 800)])
def test_token_maps(device, t, e, k, cap):
    gen = torch.Generator().manual_seed(t + e)
    ids, _ = routing(t, e, k, device, gen)
    offsets, rows, row_pair = token_maps_triton(ids, e, cap)
    ref_offsets, ref_rows = token_maps_ref(ids.cpu(), e, cap)
    assert torch.equal(offsets.cpu(), ref_offsets) and torch.equal(rows.cpu(), ref_rows)
    kept = ref_rows.flatten() >= 0
    assert torch.equal(row_pair.cpu()[ref_rows.flatten()[kept].long()], torch.arange(t * k)[kept].int())


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("t,e,k,first,cap", [(1, 4, 2, 4, None), (5, 3, 4, 3, None), (40, 6, 3, 6, 5),
                                             (300, 16, 8, 16, None), (300, 16, 8, 0, None)])
def test_token_maps_of_the_experts_from_first(device, t, e, k, first, cap):
    """``first``: the rank holds experts first .. first + E - 1 of a model with more; its
    maps equal those of the ids made local (``here_or_past``), pairs of other experts
    (before and after the ones here) in the bin past them with row -1."""
    from kernels.moe.reference import here_or_past

    gen = torch.Generator().manual_seed(t + first)
    ids, _ = routing(t, e + first + 5, k, device, gen)  # experts before, here and after
    offsets, rows, row_pair = token_maps_triton(ids, e, cap, first=first)
    local = here_or_past(ids.cpu(), first, e)
    ref_offsets, ref_rows = token_maps_ref(local, e + 1, cap)
    ref_rows = torch.where(local == e, -1, ref_rows)
    assert torch.equal(offsets.cpu(), ref_offsets[:e + 1]) and torch.equal(rows.cpu(), ref_rows)
    kept = ref_rows.flatten() >= 0
    assert kept.any() and (~kept).any()
    assert torch.equal(row_pair.cpu()[ref_rows.flatten()[kept].long()], torch.arange(t * k)[kept].int())


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,h,k", [(1, 7, 1), (5, 33, 2), (33, 130, 4)])
def test_scatter_gather(device, dtype, t, h, k):
    gen = torch.Generator().manual_seed(h)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    ids, w = routing(t, 6, k, device, gen)
    _, rows = token_maps_ref(ids.cpu(), 6)
    rows = rows.to(device)
    xs = scatter_rows_triton(x, rows)
    assert torch.equal(xs.cpu(), scatter_rows_ref(x.cpu(), rows.cpu()))  # a copy: exact
    padded = torch.full((t * k, h + 9), 7.0, device=device, dtype=dtype)  # rows of a padded send buffer
    scatter_rows_triton(x, rows, out=padded[:, 1:h + 1])
    assert torch.equal(padded[:, 1:h + 1], xs) and (padded[:, 0] == 7).all() and (padded[:, h + 1:] == 7).all()
    with pytest.raises(ValueError, match=r"out \[.*\] torch\.\w+: expected"):
        scatter_rows_triton(x, rows, out=padded[:, :h - 1 or 1].t())
    back = gather_rows_triton(xs, rows, torch.full((t, k), 1.0 / k, device=device))
    torch.testing.assert_close(back.cpu().float(), x.cpu().float(), rtol=1e-3 if dtype != torch.float32 else 1e-6,
                               atol=1e-3 if dtype != torch.float32 else 1e-6)
    out = gather_rows_triton(xs, rows, w)
    assert rel(out.cpu(), gather_rows_ref(xs.cpu().double(), rows.cpu(), w.cpu().double())) < TOL[dtype]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,e,k,es,ranks", [(1, 7, 8, 2, 1, 4), (5, 33, 6, 2, 2, 3), (33, 130, 12, 3, 1, 2)])
def test_dispatch_rows(device, dtype, t, h, e, k, es, ranks):
    """The expert-parallel send buffer: rows grouped by destination rank, each tagged with
    its local expert in the integer column after H; then the gather with a row limit (rows
    past it were never sent) leaves those units out."""
    gen = torch.Generator().manual_seed(t * h + es)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    ids, w = routing(t, e, k, device, gen)
    per_rank = e // ranks
    dest = (ids // per_rank).repeat_interleave(es, dim=1)  # [T, k * es]
    _, rows = token_maps_ref(dest.cpu(), ranks)
    rows = rows.to(device)
    out = torch.full((t * k * es, h + 16), 3.0, device=device, dtype=dtype)
    expected = dispatch_rows_ref(x.cpu(), rows.cpu(), ids.cpu(), per_rank, out.cpu().clone())
    dispatch_rows_triton(x, rows, ids, per_rank, out)
    assert torch.equal(out.cpu(), expected)  # copies and integer tags: exact
    tags = out.view(TAG_INTS[out.element_size()])[:, h].cpu().long()
    flat_rows = rows.reshape(-1).cpu().long()
    assert torch.equal(tags[flat_rows], (ids.cpu().long() % per_rank).repeat_interleave(es, dim=1).reshape(-1))
    with pytest.raises(ValueError, match=r"out \[.*\] torch\.\w+: expected a contiguous"):
        dispatch_rows_triton(x, rows, ids, per_rank, out[:, :h])
    limit = t * k * es // 2
    ww = w.repeat_interleave(es, dim=1)
    got = gather_rows_triton(out[:limit, :h].contiguous(), rows, ww, limit=limit)
    ref = gather_rows_ref(out[:, :h].cpu().double(), torch.where(rows.cpu() < limit, rows.cpu(), -1),
                          ww.cpu().double())
    assert rel(got.cpu(), ref) < TOL[dtype]
    assert torch.allclose(gather_rows_ref(out[:limit, :h].cpu().double(), rows.cpu(), ww.cpu().double(), limit), ref)


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
