"""The KV cache split over the tensor-parallel ranks by tokens (``parallel.kv_shard: tokens``).

Split by heads, each rank caches its KV heads; with fewer KV heads than ranks a head's cache
is copied on tp / num_kv_heads ranks. Split by tokens, rank r caches all KV heads of the
tokens in blocks b with b % tp == r, so no token is cached twice, and each attention
(``Attention._paged_by_tokens``):

1. gathers every rank's queries and new keys and values (each rank computes its heads');
2. stores the new keys and values whose blocks are its own;
3. attends with all query heads over its own tokens only, keeping each row's log-sum-exp;
4. sends each rank the partial outputs of that rank's heads (an all-to-all), and combines
   those of its own (each weighted by its share of the softmax's denominator) for the output
   projection (``split_attention``).

Splitting by tokens rather than by sequences (PaLM's batch-sharded attention) keeps every
rank busy whatever the batch, one sequence included, and leaves the block tables, the
schedulers and the captured steps as they are: only the slots change, per rank.
"""
from __future__ import annotations

import torch

from comm import Group, all_gather, all_to_all
from dense.attention import PagedKVCache


class TokenShardedKVCache(PagedKVCache):
    """This rank's blocks (those b with b % ranks == rank) of a paged cache of ``num_blocks``
    blocks, every KV head. Callers pass global slots (``set_step`` / ``use_slots``); the
    step's slots become this rank's: a token in another rank's block is written to the
    trash slot and not read (``own_keys`` masks it)."""

    by_tokens = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_dim: int | None = None, *, rank: int, ranks: int):
        self.rank, self.ranks = rank, ranks
        local = -(-num_blocks // ranks)
        super().__init__(num_layers, local, block_size, kv_heads, head_dim, dtype, device, v_dim)
        self.local_trash = self.trash  # this rank's padding slot
        self.num_blocks, self.trash = num_blocks, num_blocks * block_size  # the callers' (global) view
        self.own_keys: torch.Tensor | None = None

    def use_slots(self, write_slots: torch.Tensor, read_slots: torch.Tensor):
        self.own_keys = self._own(read_slots)
        super().use_slots(self._local(write_slots), self._local(read_slots))

    def _own(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots != self.trash) & ((slots // self.block_size) % self.ranks == self.rank)

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        """Global slots -> this rank's (the trash slot for another rank's tokens)."""
        bs = self.block_size
        local = (slots // bs) // self.ranks * bs + slots % bs
        return torch.where(self._own(slots), local, self.local_trash)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over some of the keys: q [B, H, T, D], k / v [B, Hkv, S, D] (grouped
    heads), ``allowed`` [B, 1, T, S] bool -> (out [B, H, T, Dv] normalized over the allowed
    keys, zero where none is; lse [B, H, T], the log of the softmax's denominator,
    -inf where none is; float32, or float64 for float64 inputs)."""
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv:
        k, v = (z.repeat_interleave(h // hkv, dim=1) for z in (k, v))
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, T]
    weights = torch.exp(scores - lse.clamp(min=torch.finfo(wide).min)[..., None])  # 0 where masked
    return (weights @ v.to(wide)).to(q.dtype), lse


def combine(outs: torch.Tensor, lses: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The ranks' partial attentions outs [P, B, H, T, D] and lses [P, B, H, T] -> the whole
    softmax's output [B, H, T, D]; ``sinks`` [H]: one more logit per head in the denominator
    (GPT-OSS), which adds no value."""
    total = torch.logsumexp(lses, dim=0)  # [B, H, T]
    if sinks is not None:
        total = torch.logaddexp(total, sinks.to(total.dtype)[None, :, None])
    # 0 for a rank with none of the keys; a row with no key anywhere (a padding row) gets
    # zeros, not NaN: its keys go to the padding slot, which masked reads still multiply.
    share = torch.exp(lses - total.clamp(min=torch.finfo(total.dtype).min)[None])  # [P, B, H, T]
    return (outs.to(share.dtype) * share[..., None]).sum(0).to(outs.dtype)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, own_keys: torch.Tensor,
                    scale: float, tp: Group, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's query heads q [B, Hr, T, D] over a cache split by tokens: k / v
    [B, Hkv, S, D] every head of this rank's keys (``own_keys`` [B, S]), ``mask`` [B, 1, T, S]
    (bool, or additive 0 / -inf). Every rank's queries attend over its own keys; each rank's
    partials of a rank's heads go to that rank, which combines them -> [B, Hr, T, Dv]."""
    allowed = (mask if mask.dtype == torch.bool else torch.isfinite(mask)) & own_keys[:, None, None, :]
    out, lse = partial_attention(all_gather(q.contiguous(), tp, dim=1), k, v, allowed, scale)
    hr, counts = q.shape[1], [q.shape[1]] * tp.size  # heads a rank: rank j receives its own from all

    def exchange(t: torch.Tensor) -> torch.Tensor:  # [B, H, ...] -> [P, B, Hr, ...]
        got = all_to_all(t.transpose(0, 1).contiguous(), counts, tp, counts)[0]  # [P * Hr, B, ...]
        return got.unflatten(0, (tp.size, hr)).transpose(1, 2)
    return combine(exchange(out), exchange(lse), sinks)
