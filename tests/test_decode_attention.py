"""The split-K decode attention kernel against its reference and torch's SDPA: GQA ratios
1, 4 and 6 (MQA), odd head dims, ragged visible keys (left padding, a current slot), one
or several splits; on CPU under the interpreter and on a GPU."""
import pytest
import torch
import torch.nn.functional as F

from kernels.decode_attention import decode_attention_ref, decode_attention_triton

CPU = pytest.param("cpu", id="interp", marks=pytest.mark.interp)
GPU = pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(device, dtype, b, hq, hkv, s, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
    k = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    v = torch.randn(b, hkv, s, d, generator=gen).to(device, dtype)
    # Row i: left padding, then visible keys up to its current slot; later slots hidden.
    slot = torch.randint(0, s, (b,), generator=gen)
    pad = (torch.rand(b, generator=gen) * slot.float()).long()
    pos = torch.arange(s)
    visible = (pos[None, :] >= pad[:, None]) & (pos[None, :] <= slot[:, None])
    return q, k, v, visible.to(device)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 4, 4, 1, 16), (3, 8, 2, 37, 24), (2, 6, 1, 130, 16)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_attention_matches_reference(device, dtype, b, hq, hkv, s, d, splits):
    q, k, v, visible = case(device, dtype, b, hq, hkv, s, d, seed=s + d)
    out = decode_attention_triton(q, k, v, visible, splits=splits)
    ref = decode_attention_ref(q.double(), k.double(), v.double(), visible)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, ref) < TOL[dtype]
    sdpa = F.scaled_dot_product_attention(q.double()[:, :, None], k.double(), v.double(),
                                          attn_mask=visible[:, None, None, :], enable_gqa=hq != hkv)[:, :, 0]
    assert rel(ref, sdpa) < 1e-12


def test_decode_attention_reads_strided_caches_and_rejects_bad_shapes():
    """The cache of one layer is a view of [layers, B, Hkv, S, D]; a wider cache than the
    visible keys is the static decode step's case."""
    q, k, v, visible = case("cpu", torch.float32, 2, 4, 2, 20, 16, seed=1)
    big_k = torch.zeros(3, 2, 2, 20, 16)
    big_k[1] = k
    out = decode_attention_triton(q, big_k[1], v, visible, splits=2)
    assert rel(out, decode_attention_ref(q, k, v, visible)) < 1e-5
    with pytest.raises(ValueError, match=r"Hkv dividing Hq"):
        decode_attention_triton(q, k[:, :1].expand(2, 3, 20, 16), v, visible)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,s,d,block", [(1, 4, 4, 5, 16, 4), (3, 8, 2, 37, 24, 8), (4, 6, 1, 130, 16, 16)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_paged_decode_attention_reads_the_pool_in_place(device, dtype, b, hq, hkv, s, d, block, splits):
    """Each row's keys in scattered blocks of a shared pool (as PagedKVCache holds them),
    rows of different lengths, hidden slots pointing at a trash row: the same result as
    the dense reference over the keys gathered in order."""
    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.dense_ref import paged_decode_attention_ref

    gen = torch.Generator().manual_seed(b * s + d)
    blocks = -(-s // block)
    n = b * blocks * block + 1  # the last pool row takes what nothing should read
    k = torch.randn(n, hkv, d, generator=gen).to(device, dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(device, dtype)
    k[-1], v[-1] = float("nan"), float("nan")  # a read of the trash row would poison the output
    q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
    order = torch.randperm(b * blocks, generator=gen).view(b, blocks)  # each row's block table
    pos = torch.arange(s)
    slots = order[:, pos // block] * block + pos % block  # [B, S]
    lens = torch.randint(1, s + 1, (b,), generator=gen)
    visible = pos[None, :] < lens[:, None]
    slots = torch.where(visible, slots, n - 1).to(device)
    visible = visible.to(device)
    out = paged_decode_attention_triton(q, k, v, slots, visible, splits=splits)
    ref = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, visible)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    assert rel(out, ref) < TOL[dtype]
    kd, vd = (t.double().nan_to_num()[slots].transpose(1, 2) for t in (k, v))
    dense = decode_attention_ref(q.double(), kd, vd, visible)
    assert rel(ref, dense) < 1e-12
    with pytest.raises(ValueError, match=r"slots: expected contiguous int64"):
        paged_decode_attention_triton(q, k, v, slots.int(), visible)
