"""Decode attention over a paged KV pool (``kernels.attention.decode``) against its float64
references, on CPU under the interpreter and on a GPU, and the split kernels' Triton
compiles for sm_90 (tests.hopper): split-K decode attention over a pool read in place, also
against torch's SDPA: GQA ratios 1, 4 and 6 (MQA), odd head dims, ragged visible keys (left
padding, a current slot), one or several splits, each row's keys walked to its position
alone, attention sinks, partials over shares of the keys; its latent-attention form (one
cached row of latent and rotary key for every head, the latent also the value) against the
same keys expanded per head, with head counts past one block of 16 and widths that are not
powers of two."""
import pytest
import torch
import torch.nn.functional as F

from kernels.attention.decode import (merge_partials_triton, paged_decode_attention_triton,
                                     paged_decode_partial_triton, paged_latent_decode_triton)
from kernels.attention.reference import (decode_attention_ref, merge_partials_ref, paged_decode_attention_ref,
                                         paged_decode_partial_ref, paged_latent_decode_ref)
from tests.hopper import compile_kernel
from tests.kernels.common import CPU, GPU, paged_pool, rel

DECODE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


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


def in_pool(k, v, block, gen):
    """A dense cache k / v [B, Hkv, S, D] scattered in blocks of ``block`` keys over a pool
    [N, Hkv, D] in random order -> (k pool, v pool, slots [B, S]: each key's pool row)."""
    b, hkv, s, d = k.shape
    blocks = -(-s // block)
    order = torch.randperm(b * blocks, generator=gen).view(b, blocks).to(k.device)
    pos = torch.arange(s, device=k.device)
    slots = order[:, pos // block] * block + pos % block  # [B, S]
    pools = []
    for t in (k, v):
        pool = torch.zeros(b * blocks * block, hkv, d, dtype=t.dtype, device=t.device)
        pool[slots.reshape(-1)] = t.transpose(1, 2).reshape(b * s, hkv, d)
        pools.append(pool)
    return pools[0], pools[1], slots.contiguous()


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 4, 4, 1, 16), (3, 8, 2, 37, 24), (2, 6, 1, 130, 16)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_decode_attention_matches_reference(device, dtype, b, hq, hkv, s, d, splits):
    """GQA 1, 4 and 6 (MQA), an odd head dim, ragged visible keys (left padding, a current
    slot) over a pool: the dense reference over the same keys, and torch's SDPA."""
    q, k, v, visible = case(device, dtype, b, hq, hkv, s, d, seed=s + d)
    k_pool, v_pool, slots = in_pool(k, v, 8, torch.Generator().manual_seed(s))
    out = paged_decode_attention_triton(q, k_pool, v_pool, slots, visible, splits=splits)
    ref = decode_attention_ref(q.double(), k.double(), v.double(), visible)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, ref) < DECODE_TOL[dtype]
    sdpa = F.scaled_dot_product_attention(q.double()[:, :, None], k.double(), v.double(),
                                          attn_mask=visible[:, None, None, :], enable_gqa=hq != hkv)[:, :, 0]
    assert rel(ref, sdpa) < 1e-12


def test_decode_attention_rejects_bad_shapes():
    q, k, v, visible = case("cpu", torch.float32, 2, 4, 2, 20, 16, seed=1)
    k_pool, v_pool, slots = in_pool(k, v, 8, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"Hkv dividing Hq"):
        paged_decode_attention_triton(q, k_pool[:, :1].expand(-1, 3, 16), v_pool, slots, visible)
    with pytest.raises(ValueError, match=r"\[B, S\] twice"):
        paged_decode_attention_triton(q, k_pool, v_pool, slots[:, :5], visible)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,s,d,block", [(1, 4, 4, 5, 16, 4), (3, 8, 2, 37, 24, 8), (4, 6, 1, 130, 16, 16)])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_paged_decode_attention_reads_the_pool_in_place(device, dtype, b, hq, hkv, s, d, block, splits):
    """Each row's keys in scattered blocks of a shared pool (as PagedKVCache holds them),
    rows of different lengths, hidden slots pointing at a trash row: the same result as
    the dense reference over the keys gathered in order; an additive mask (0 / -inf, as
    StepContext.paged builds it) gives the same as the bool one."""
    gen = torch.Generator().manual_seed(b * s + d)
    lens = torch.randint(1, s + 1, (b,), generator=gen)
    slots, k, v = paged_pool(device, dtype, hkv, d, s, block, lens, gen)
    q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
    visible = (torch.arange(s)[None, :] < lens[:, None]).to(device)
    out = paged_decode_attention_triton(q, k, v, slots, visible, splits=splits)
    ref = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, visible)
    assert out.shape == q.shape and out.dtype == dtype and not out.isnan().any()
    assert rel(out, ref) < DECODE_TOL[dtype]
    kd, vd = (t.double().nan_to_num()[slots].transpose(1, 2) for t in (k, v))
    dense = decode_attention_ref(q.double(), kd, vd, visible)
    assert rel(ref, dense) < 1e-12
    bias = torch.zeros(b, 1, 1, s, dtype=dtype, device=device).masked_fill_(~visible[:, None, None], float("-inf"))
    assert torch.equal(paged_decode_attention_triton(q, k, v, slots, bias[:, 0, 0], splits=splits), out)
    assert torch.equal(paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, bias[:, 0, 0]), ref)
    with pytest.raises(ValueError, match=r"slots: expected contiguous int64"):
        paged_decode_attention_triton(q, k, v, slots.int(), visible)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,hkv,s,d,splits", [(3, 8, 2, 70, 24, 4), (2, 4, 4, 300, 16, None), (1, 6, 1, 9, 16, 4)])
def test_paged_decode_attention_walks_each_row_to_its_position(device, dtype, b, hq, hkv, s, d, splits):
    """With ``positions`` each row's keys are split by its own length: keys after its
    position (their slots at the pool's NaN row) are never read, even where the mask would
    show them (the contract hides them), so the output is attention over keys 0 ..
    position alone, with a window's hidden keys (before a row's first visible one) still
    hidden; fewer keys than splits."""
    gen = torch.Generator().manual_seed(s + d)
    positions = torch.randint(0, s, (b,), generator=gen)
    positions[0] = s // 3
    slots, k, v = paged_pool(device, dtype, hkv, d, s, 8, positions + 1, gen)  # past it: the NaN row
    q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
    first = (positions * torch.rand(b, generator=gen)).long().to(device)  # a window's start
    positions = positions.to(device)
    pos = torch.arange(s, device=device)[None, :]
    shown = pos >= first[:, None]  # every key from the window's start on, past the position too
    upto = shown & (pos <= positions[:, None])
    got = paged_decode_attention_triton(q, k, v, slots, shown, splits=splits, positions=positions)
    want = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, upto)
    assert rel(got, want) < DECODE_TOL[dtype]
    with pytest.raises(ValueError, match="positions"):
        paged_decode_attention_triton(q, k, v, slots, shown, positions=positions.int())


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_attention_with_sinks(device, splits):
    """GPT-OSS's sinks: a logit per head in the softmax beside the keys, adding no value --
    the kernel (joined in the combine of the splits) against the reference, which appends
    the sink as one more score; large sinks shrink the output, as they should."""
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d = 3, 8, 2, 37, 16
    lens = torch.tensor([37, 5, 1])
    slots, k, v = paged_pool(device, torch.float32, hkv, d, s, 8, lens, gen)
    q = torch.randn(b, hq, d, generator=gen).to(device)
    visible = (torch.arange(s)[None, :] < lens[:, None]).to(device)
    sinks = (2 * torch.randn(hq, generator=gen)).to(device)
    out = paged_decode_attention_triton(q, k, v, slots, visible, splits=splits, sinks=sinks)
    ref = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, visible, sinks=sinks.double())
    assert rel(out, ref) < DECODE_TOL[torch.float32]
    plain = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, visible)
    assert rel(ref, plain) > 1e-2
    huge = paged_decode_attention_triton(q, k, v, slots, visible, splits=splits, sinks=sinks + 30)
    assert huge.abs().max() < 1e-6 * out.abs().max()
    with pytest.raises(ValueError, match=r"sinks \[4\]: expected one logit per query head, \[8\]"):
        paged_decode_attention_triton(q, k, v, slots, visible, sinks=sinks[:4])


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4, None])
def test_paged_decode_partials_over_shares_of_the_keys_merge_to_the_whole(device, dtype, splits):
    """The partial form (a KV cache split over ranks by tokens): each of three shares of the
    keys (every third block) gives out and log-sum-exp as the reference does, zero and -inf
    for a row with no key in its share; the shares merged by their denominators equal the
    attention over every key, sinks included."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, s, d, block, ranks = 4, 8, 2, 70, 16, 8, 3
    lens = torch.tensor([70, 9, 1, 30])  # the rows of 9 and 1 keys have none in some shares
    slots, k, v = paged_pool(device, dtype, hkv, d, s, block, lens, gen)
    q = torch.randn(b, hq, d, generator=gen).to(device, dtype)
    visible = (torch.arange(s)[None, :] < lens[:, None]).to(device)
    owner = (torch.arange(s, device=device) // block) % ranks
    outs, lses = [], []
    for r in range(ranks):
        mine = visible & (owner == r)
        out, lse = paged_decode_partial_triton(q, k, v, slots, mine, splits=splits)
        ref_out, ref_lse = paged_decode_partial_ref(q.double(), k.double(), v.double(), slots, mine)
        assert out.dtype == dtype and lse.dtype == torch.float32 and torch.isfinite(out).all()
        assert rel(out, ref_out) < DECODE_TOL[dtype]
        assert torch.equal(torch.isinf(lse), ~mine.any(1)[:, None].expand(-1, hq))
        assert not out[~mine.any(1)].any()
        assert (lse - ref_lse).abs().nan_to_num().max() < 1e-4
        outs.append(out.float())
        lses.append(lse)
    sinks = torch.randn(hq, generator=gen).to(device)
    packed = torch.stack([torch.cat([o, lse[..., None]], dim=-1).transpose(0, 1)[:, :, None]
                          for o, lse in zip(outs, lses)]).contiguous()  # [P, Hq, B, 1, D + 1]
    merged = merge_partials_triton(packed, sinks, dtype)[:, :, 0]  # [B, Hq, D]
    assert merged.dtype == dtype
    whole = paged_decode_attention_ref(q.double(), k.double(), v.double(), slots, visible, sinks=sinks.double())
    assert rel(merged, whole) < DECODE_TOL[dtype]
    assert rel(merged, merge_partials_ref(packed.double(), sinks.double(), torch.float64)[:, :, 0]) < DECODE_TOL[dtype]


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("shares,t,d,sinks", [(2, 1, 16, False), (3, 2, 40, True), (4, 1, 512, True)])
def test_merge_partials_matches_its_reference(device, shares, t, d, sinks):
    """The shares' merge in one launch against its reference: a share with no key (zeros,
    -inf), a row with no key in any share (zeros, no NaN, sinks or not), several tokens a
    row, widths that are not powers of two and latent attention's 512."""
    gen = torch.Generator().manual_seed(shares * d)
    b, h = 3, 4
    outs = torch.randn(shares, h, b, t, d, generator=gen)
    lses = torch.randn(shares, h, b, t, generator=gen) * 3
    lses[0, :, 1] = -torch.inf  # row 1 has no key in share 0
    lses[:, :, 2] = -torch.inf  # row 2 none anywhere (padding)
    outs[lses == -torch.inf] = 0
    packed = torch.cat([outs, lses[..., None]], dim=-1).to(device)
    sink = torch.randn(h, generator=gen).to(device) if sinks else None
    got = merge_partials_triton(packed, sink, torch.float32)
    want = merge_partials_ref(packed.double(), None if sink is None else sink.double(), torch.float64)
    assert got.shape == (b, h, t, d) and torch.isfinite(got).all() and not got[2].any()
    assert rel(got, want) < 1e-5
    with pytest.raises(ValueError, match=r"expected contiguous float32 \[P, H, B, T, Dv \+ 1\]"):
        merge_partials_triton(packed.transpose(0, 1), sink, torch.float32)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,hq,latent,rope,s,splits", [(1, 4, 32, 16, 5, 1), (3, 20, 24, 8, 45, 4),
                                                         (2, 16, 64, 16, 130, None), (1, 16, 32, 16, 300, 2)])
def test_paged_latent_decode_matches_per_head_attention(device, dtype, b, hq, latent, rope, s, splits):
    """Latent attention's decode: every head attends over one shared cached row (latent,
    then rotary key) and takes the latent as its value -- the same as ordinary attention
    with that row copied to each head as key and its latent part as value (float64 SDPA)."""
    gen = torch.Generator().manual_seed(hq + s)
    q = torch.randn(b, hq, latent + rope, generator=gen).to(device, dtype)
    rows = torch.randn(b, 1, s, latent + rope, generator=gen).to(device, dtype)
    _, _, _, visible = case(device, dtype, b, 1, 1, s, 16, seed=s)
    pool, _, slots = in_pool(rows, rows, 8, gen)  # [N, 1, C + R]
    scale = 0.3
    out = paged_latent_decode_triton(q, pool, slots, visible, latent, scale, splits=splits)
    assert out.shape == (b, hq, latent) and out.dtype == dtype
    k = rows.double().expand(b, hq, s, latent + rope)
    want = F.scaled_dot_product_attention(q.double()[:, :, None], k, k[..., :latent], attn_mask=visible[:, None, None],
                                          scale=scale)[:, :, 0]
    assert rel(out, want) < DECODE_TOL[dtype]
    ref = paged_latent_decode_ref(q.double(), pool.double(), slots, visible, latent, scale)
    assert rel(ref, want) < 1e-12


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("b,s,splits", [(3, 70, 4), (2, 300, None)])
def test_paged_latent_decode_walks_each_row_to_its_position(device, b, s, splits):
    """With ``positions`` each row's keys are split by its own length: keys after its
    position are never read, even where the mask would show them (the contract hides
    them), so the output is attention over keys 0 .. position alone."""
    gen = torch.Generator().manual_seed(s)
    hq, latent, rope = 16, 32, 16
    q = torch.randn(b, hq, latent + rope, generator=gen).to(device)
    rows = torch.randn(b, 1, s, latent + rope, generator=gen).to(device)
    pool, _, slots = in_pool(rows, rows, 8, gen)
    positions = torch.randint(0, s, (b,), generator=gen).to(device)
    positions[0] = s // 3
    upto = torch.arange(s, device=device)[None, :] <= positions[:, None]  # [B, S]
    everything = torch.ones(b, s, dtype=torch.bool, device=device)
    got = paged_latent_decode_triton(q, pool, slots, everything, latent, 0.3, splits=splits, positions=positions)
    want = paged_latent_decode_ref(q, pool, slots, upto, latent, 0.3)
    assert rel(got, want) < DECODE_TOL[torch.float32]
    with pytest.raises(ValueError, match="positions"):
        paged_latent_decode_triton(q, pool, slots, everything, latent, positions=positions.int())


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,n,c,r,p,rope", [(1, 16, 64, 16, 24, True), (3, 20, 40, 8, 12, True),
                                              (2, 5, 24, 8, 8, False), (37, 3, 136, 16, 40, True)])
def test_latent_prologue_matches_reference(device, dtype, b, n, c, r, p, rope):
    """Latent attention's decode step before its attention in one launch (each head's
    absorbed query, the latent's norm, the rotary turn of the queries and the key, the
    cache append): the queries and the pool rows written against the float64 reference, no
    other pool row touched; head counts past one block of 16, latents that are not powers
    of two and past one column block, rows past one block of 16 and past the programs (37
    rows over 3 x 3 programs), no rotation, W_UK a strided view of kv_b_proj's heads."""
    from kernels.attention.latent_triton import latent_prologue_triton
    from kernels.attention.reference import latent_prologue_ref

    gen = torch.Generator().manual_seed(b * n + c)
    w_uk = torch.randn(n, p + 7, c, generator=gen).div(p ** 0.5).to(device, dtype)[:, :p]  # W_UK rows, then others
    q = torch.randn(b, n * (p + r), generator=gen).to(device, dtype)
    kv = (torch.randn(b, c + r, generator=gen) * 3).to(device, dtype)
    norm_w = (torch.rand(c, generator=gen) + 0.5).to(device, dtype)
    ang = torch.rand(b, r // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(device, dtype) for f in (torch.cos, torch.sin))
    cos, sin = (cos, sin) if rope else (None, None)
    pool = torch.randn(b + 9, 1, c + r, generator=gen).to(device, dtype)
    slot = torch.randperm(b + 9, generator=gen)[:b].to(device)
    up = lambda z: None if z is None else z.double()  # noqa: E731
    pool_ref = pool.double()
    want = latent_prologue_ref(q.double(), w_uk.double(), kv.double(), norm_w.double(), 1e-6, up(cos), up(sin),
                               pool_ref, slot)
    before = pool.clone()
    out = latent_prologue_triton(q, w_uk, kv, norm_w, 1e-6, cos, sin, pool, slot)
    assert out.shape == (b, n, c + r) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(out, want) < tol and rel(pool[slot], pool_ref[slot]) < tol
    assert rel(out[..., :c], want[..., :c]) < tol and rel(out[..., c:], want[..., c:]) < tol
    others = torch.ones(b + 9, dtype=torch.bool, device=device).index_fill_(0, slot, False)
    assert torch.equal(pool[others], before[others])


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,n,c,v", [(1, 16, 512, 128), (19, 3, 40, 24), (2, 5, 136, 8)])
def test_latent_output_matches_reference(device, dtype, b, n, c, v):
    """Latent attention's value up-projection in one launch, against the float64 reference:
    DeepSeek's widths, rows past one block of 16, latents past one block of the reduction
    and not powers of two, value widths below one column block; W_UV a strided view of
    kv_b_proj's heads, x a view with heads strided."""
    from kernels.attention.latent_triton import latent_output_triton
    from kernels.attention.reference import latent_output_ref

    gen = torch.Generator().manual_seed(b * n + c + v)
    w_uv = torch.randn(n, 5 + v, c, generator=gen).div(c ** 0.5).to(device, dtype)[:, 5:]  # W_UK rows, then W_UV
    x = torch.randn(b, 2 * n, c, generator=gen).to(device, dtype)[:, ::2]
    out = latent_output_triton(x, w_uv)
    assert out.shape == (b, n * v) and out.dtype == dtype
    want = latent_output_ref(x.double(), w_uv.double())
    assert rel(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="expected \\[B, N, C\\] and \\[N, V, C\\]"):
        latent_output_ref(x, w_uv[:, :, 1:])


def test_paged_latent_decode_rejects_bad_shapes():
    q, pool = torch.zeros(1, 4, 48), torch.zeros(16, 1, 48)
    slots, visible = torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="0 < C < C \\+ R"):
        paged_latent_decode_triton(q, pool, slots, visible, latent=48)
    with pytest.raises(ValueError, match="one latent row a slot"):
        paged_latent_decode_triton(q, torch.zeros(16, 2, 48), slots, visible, latent=32)
    with pytest.raises(ValueError, match="int64"):
        paged_latent_decode_triton(q, pool, slots.int(), visible, latent=32)


_COMPILE_LATENT = """
import sys
from kernels.attention.decode import _latent_split_kernel as kernel

additive, pdl, block = bool(int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
const = dict(HQ=16, HB=16, C=512, C_PAD=512, R=64, R_PAD=64, BLOCK_S=block, SPLIT_LEN=4 * block, P=16, IEEE=False,
             UPCAST=False, STAGES=3, POS=True, ADDITIVE=additive, PDL=pdl)
types = {"slot_ptr": "*i64", "mask_ptr": "*fp32" if additive else "*i8", "m_ptr": "*fp32", "l_ptr": "*fp32",
         "acc_ptr": "*fp32", "pos_ptr": "*i64", "S": "i32", "scale": "fp32"}
"""


@pytest.mark.parametrize("additive, pdl, block", [(0, 0, 16), (1, 2, 32)])
def test_paged_latent_decode_compiles_for_hopper(additive, pdl, block):
    """The latent-attention decode kernel's whole Triton compile for sm_90 (tests.hopper) at
    DeepSeek's widths (latent 512, rotary 64) with bf16 products, pipelined, with an
    additive mask or a bool one, with PDL and without, at both key blocks and warp counts
    it picks."""
    assert compile_kernel(_COMPILE_LATENT, additive, pdl, block, warps=4 if block == 16 else 8) > 0


_COMPILE_PAGED = """
import sys
from kernels.attention.decode import _paged_split_kernel as kernel

additive, g = bool(int(sys.argv[1])), int(sys.argv[2])
const = dict(G=g, G_PAD=max(16, g), D_PAD=128, BLOCK_S=32, SPLIT_LEN=256, P=16, IEEE=False, UPCAST=False, STAGES=3,
             POS=True, ADDITIVE=additive)
types = {"slot_ptr": "*i64", "mask_ptr": "*fp32" if additive else "*i8", "m_ptr": "*fp32", "l_ptr": "*fp32",
         "acc_ptr": "*fp32", "pos_ptr": "*i64", "S": "i32", "D": "i32", "scale": "fp32"}
"""


@pytest.mark.parametrize("additive, g", [(0, 1), (1, 8)])
def test_paged_decode_compiles_for_hopper(additive, g):
    """The paged decode split kernel's whole Triton compile for sm_90 (tests.hopper) at head
    dim 128 with bf16 products, pipelined, bounded by positions, with an additive mask or a
    bool one, for one query head a KV head (MHA) and eight (GQA)."""
    assert compile_kernel(_COMPILE_PAGED, additive, g, warps=2) > 0


_COMPILE_LATENT_PROLOGUE = """
import sys
from kernels.attention.latent_triton import _latent_query_kernel as kernel

pdl = int(sys.argv[1])
const = dict(N=16, C=512, C_PAD=512, BLOCK_C=64, R=64, P=128, P_PAD=128, BLOCK_B=16, ROPE=True, IEEE=False, PDL=pdl)
types = {"slot_ptr": "*i64", "B": "i32", "eps": "fp32"}
"""


@pytest.mark.parametrize("pdl", [0, 2])
def test_latent_prologue_compiles_for_hopper(pdl):
    """The latent-attention decode prologue's whole Triton compile for sm_90 (tests.hopper)
    at DeepSeek-V2-Lite's widths (16 heads, latent 512, rotary 64, position-free 128)."""
    assert compile_kernel(_COMPILE_LATENT_PROLOGUE, pdl) > 0


_COMPILE_LATENT_OUTPUT = """
import sys
from kernels.attention.latent_triton import _latent_output_kernel as kernel

pdl = int(sys.argv[1])
const = dict(N=16, C=512, V=128, BLOCK_V=16, BLOCK_K=512, BLOCK_B=16, IEEE=False, PDL=pdl)
types = {"B": "i32"}
"""


@pytest.mark.parametrize("pdl", [0, 2])
def test_latent_output_compiles_for_hopper(pdl):
    """The value up-projection kernel's whole Triton compile for sm_90 at DeepSeek's widths."""
    assert compile_kernel(_COMPILE_LATENT_OUTPUT, pdl) > 0
