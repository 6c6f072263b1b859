"""Getting tokens to their experts and back (steps 2-3 of the MoE layer and the inverse).

Shape letters: T tokens, H hidden, E experts, k slots.
A dispatcher owns where experts live. With all experts on this device the maps, the
layout transform, the experts and the combine run as one fused kernel sequence
(``kernels.fused_moe``); expert-parallel dispatchers keep this interface and put the
all-to-all between the layout transform and the experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels
from comm import ParallelGroups, all_reduce, all_to_all


class LocalDispatcher:
    """All experts on this device."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float | None = None):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None  # dropless
        return max(1, math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor))

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        """x [T, H] and its Routing -> the weighted expert outputs [T, H]."""
        return experts.fused(x, routing.expert_ids, routing.weights, self.capacity(x.shape[0]),
                             routing.maps)


class ExpertParallelDispatcher:
    """Experts placed over the ``ep * expert_slicing`` consecutive ranks of the EP group:
    expert e lives on EP rank e // (E / ep), sliced over the ``expert_slicing`` ranks from
    (e // (E / ep)) * expert_slicing on. A (pair, slice) unit goes to one of those ranks.

    Naive (the baseline): every rank sends all its units over the whole EP group and
    combines every returned row itself.
    PCC (paper V-B): after a TP layer the ranks of a TP group hold the same tokens, so TP
    rank i sends only the units whose destination rank has TP index i, within the ranks
    that share TP index i (p / L peers, not p), and an all-reduce inside the TP group adds
    the partial combines. Each unit crosses the network once per TP group.
    """

    def __init__(self, num_experts: int, top_k: int, ep: int, expert_slicing: int,
                 groups: ParallelGroups, pcc: bool):
        self.e_local, self.top_k, self.ep, self.es = num_experts // ep, top_k, ep, expert_slicing
        self.groups = groups
        tp = groups.tp.size
        self.pcc = pcc and tp > 1
        if self.pcc and (ep * expert_slicing) % tp:
            raise ValueError(f"parallel.pcc: needs ep * expert_slicing to be a multiple of tp (got ep={ep}, "
                             f"expert_slicing={expert_slicing}, tp={tp}); use pcc: false")
        if self.pcc:
            # Each rank of my EP block, as an index into my PCC group (-1: another TP index).
            where = {r: i for i, r in enumerate(groups.pcc.ranks)}
            self.dest_of = torch.tensor([where.get(r, -1) for r in groups.ep.ranks], device="cpu")
        self.sent_pairs = 0  # (pair, slice) units this rank sent in the last call: for checks

    def dispatch(self, x: torch.Tensor, routing) -> "Sent":
        """Layout transform by destination rank, then the all-to-all of rows and expert ids."""
        t = x.shape[0]
        ids = routing.expert_ids.long().reshape(-1)  # [T * k]
        token = torch.arange(t, device=x.device).repeat_interleave(self.top_k)
        weight = routing.weights.reshape(-1).float()
        # Every slice of the expert gets the pair: unit (pair, s) goes to EP-block offset
        # owner * es + s.
        s = torch.arange(self.es, device=x.device)
        dest = ((ids // self.e_local)[:, None] * self.es + s[None, :]).reshape(-1)
        ids, token, weight = (z.repeat_interleave(self.es) for z in (ids, token, weight))
        group = self.groups.ep
        if self.pcc:  # only the units bound for ranks with my TP index, among those ranks
            mine = dest % self.groups.tp.size == self.groups.tp.rank
            ids, token, weight = ids[mine], token[mine], weight[mine]
            dest, group = self.dest_of.to(x.device)[dest[mine]], self.groups.pcc
        # The same maps as for experts, over destination ranks: rows grouped by destination.
        offsets, rows = kernels.token_maps(dest[:, None].int(), group.size)
        order = torch.empty_like(dest)
        order[rows.reshape(-1).long()] = torch.arange(dest.numel(), device=x.device)
        counts = offsets[1:] - offsets[:-1]
        self.sent_pairs = int(dest.numel())
        recv_x, recv_counts = all_to_all(x[token[order]], counts, group)
        recv_e, _ = all_to_all((ids[order] % self.e_local)[:, None], counts, group)
        return Sent(recv_x, recv_e, recv_counts, counts, token[order], weight[order], group)

    @staticmethod
    def compute(sent: "Sent", experts) -> torch.Tensor:
        """This rank's experts on the rows it received (each routed to one local expert)."""
        if not sent.x.shape[0]:
            return sent.x
        ones = torch.ones(sent.x.shape[0], 1, device=sent.x.device)
        return experts.fused(sent.x, sent.expert.int(), ones)

    def combine(self, y: torch.Tensor, sent: "Sent", num_tokens: int) -> torch.Tensor:
        """Rows back to their senders, weighted sum per token (+ the TP all-reduce under PCC)."""
        back, _ = all_to_all(y, sent.recv_counts, sent.group)  # in the order they were sent
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, sent.token, back.float() * sent.weight[:, None])
        if self.pcc:
            all_reduce(out, self.groups.tp)  # each TP rank combined only its share of pairs
        return out.to(y.dtype)

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        sent = self.dispatch(x, routing)
        return self.combine(self.compute(sent, experts), sent, x.shape[0])


@dataclass
class Sent:
    """What one rank received in the dispatch all-to-all, and how to undo it."""

    x: torch.Tensor  # [M, H] rows received, grouped by source rank
    expert: torch.Tensor  # [M, 1] local expert of each received row
    recv_counts: torch.Tensor  # [group size] rows from each source
    send_counts: torch.Tensor  # [group size] rows this rank sent to each destination
    token: torch.Tensor  # [N] token of each sent row, in send order
    weight: torch.Tensor  # [N] combine weight of each sent row
    group: object  # the comm.Group of the all-to-all
