"""The KV cache split over the tensor-parallel ranks by tokens (``parallel.kv_shard: tokens``).

Split by heads, each rank caches its KV heads; with fewer KV heads than ranks a head's cache
is copied on tp / num_kv_heads ranks. Split by tokens, rank r caches all KV heads of the
tokens in blocks b with b % tp == r, so no token is cached twice, and each attention
(``Attention._paged_by_tokens``):

1. gathers every rank's queries and new keys and values (each rank computes its heads'), in
   one all-gather (``gather_heads``; a decode step gathers the QKV rows before their
   epilogue and runs it on each rank's part in one launch, which also does step 2);
2. stores the new keys and values whose blocks are its own;
3. attends with all query heads over its own tokens only, keeping each row's log-sum-exp: a
   decode step reads its keys in place (``kernels.paged_decode_partial``), other steps
   through a gathered copy (``split_attention``);
4. sends each rank the partial outputs of that rank's heads with their log-sum-exps (one
   all-to-all), and merges those of its own (each weighted by its share of the softmax's
   denominator; ``kernels.merge_partials``, one launch on a GPU) for the output projection
   (``combine_heads``).

Splitting by tokens rather than by sequences (PaLM's batch-sharded attention) keeps every
rank busy whatever the batch, one sequence included, and leaves the block tables, the
schedulers and the captured steps as they are: only the slots change, per rank.
"""
from __future__ import annotations

import torch

import kernels
from comm import Group, all_gather, all_to_all
from dense.attention import PagedKVCache
from kernels.attention.reference import partial_attention_ref


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
        self._visible: tuple | None = None  # (a step's mask, the keys of it read here)

    def use_slots(self, write_slots: torch.Tensor, read_slots: torch.Tensor):
        self.own_keys = self._own(read_slots)
        self._visible = None
        super().use_slots(self._local(write_slots), self._local(read_slots))

    def visible(self, mask: torch.Tensor) -> torch.Tensor:
        """A decode step's mask [B, 1, 1, S] -> the keys each row reads here, bool [B, S]:
        made once a step for the layers that share the mask."""
        if self._visible is None or self._visible[0] is not mask:
            self._visible = (mask, own(mask, self.own_keys)[:, 0, 0])
        return self._visible[1]

    def _own(self, slots: torch.Tensor) -> torch.Tensor:
        return (slots != self.trash) & ((slots // self.block_size) % self.ranks == self.rank)

    def _local(self, slots: torch.Tensor) -> torch.Tensor:
        """Global slots -> this rank's (the trash slot for another rank's tokens)."""
        bs = self.block_size
        local = (slots // bs) // self.ranks * bs + slots % bs
        return torch.where(self._own(slots), local, self.local_trash)


def gather_heads(tp: Group, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's heads of each of ``parts`` ([B, h_i, T, D] each, this rank's; the same
    h_i on every rank) -> [B, P * h_i, T, D] each, rank by rank: one all-gather for all."""
    if tp.size == 1:
        return list(parts)
    sizes = [z.shape[1] for z in parts]
    got = all_gather(torch.cat(parts, dim=1), tp, dim=0)  # [P * B, sum h_i, T, D]
    got = got.unflatten(0, (tp.size, parts[0].shape[0])).transpose(0, 1)  # [B, P, sum h_i, T, D]
    return [z.flatten(1, 2) for z in got.split(sizes, dim=2)]


def combine_heads(out: torch.Tensor, lse: torch.Tensor, tp: Group, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's partial attention of every rank's query heads over its own keys, out
    [B, H, T, Dv] and lse [B, H, T] -> the whole attention of this rank's heads
    [B, H / P, T, Dv]: each rank's partials of a rank's heads go to that rank (one
    all-to-all of both, packed), which merges them (``kernels.merge_partials``; ``sinks``:
    this rank's heads')."""
    b, h, t, dv = out.shape
    hr = h // tp.size
    packed = torch.cat([out.to(lse.dtype), lse[..., None]], dim=-1).transpose(0, 1).contiguous()  # [H, B, T, Dv + 1]
    counts = [hr] * tp.size  # heads a rank: rank j receives its own from every rank
    got = all_to_all(packed, counts, tp, counts)[0]  # [P * Hr, B, T, Dv + 1]: every rank's partials of these heads
    return kernels.merge_partials(got.view(tp.size, hr, b, t, dv + 1), sinks, out.dtype)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, own_keys: torch.Tensor,
                    scale: float, tp: Group, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every rank's query heads q [B, H, T, D] (``gather_heads``) over a cache
    split by tokens: k / v [B, Hkv, S, D] every head of this rank's keys (``own_keys``
    [B, S]), ``mask`` [B, 1, T, S] (bool, or additive 0 / -inf) -> this rank's heads'
    [B, H / P, T, Dv] (``combine_heads``)."""
    out, lse = partial_attention_ref(q, k, v, own(mask, own_keys), scale)
    return combine_heads(out, lse, tp, sinks)


def own(mask: torch.Tensor, own_keys: torch.Tensor) -> torch.Tensor:
    """A step's mask [B, 1, T, S] (bool, or additive 0 / -inf) and this rank's keys [B, S] ->
    the keys each query may read here, bool [B, 1, T, S]."""
    return (mask if mask.dtype == torch.bool else torch.isfinite(mask)) & own_keys[:, None, None, :]
