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
from comm import ParallelGroups, all_reduce, all_to_all, exchange_counts


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
        # Destination of a (pair, slice) unit, as an index into the all-to-all group; the
        # group size (it sorts last) marks the units another TP rank sends under PCC.
        if self.pcc:
            where = {r: i for i, r in enumerate(groups.pcc.ranks)}
            dest_of = [where.get(r, groups.pcc.size) for r in groups.ep.ranks]
        else:
            dest_of = list(range(groups.ep.size))
        self.dest_of = torch.tensor(dest_of, device="cpu")  # moved to the tokens' device on first use
        self.group = groups.pcc if self.pcc else groups.ep
        self.sent_pairs = 0  # (pair, slice) units this rank sent in the last call: for checks

    def dispatch(self, x: torch.Tensor, routing) -> "Sent":
        """Layout transform by destination rank, then one all-to-all of the rows, each with
        its local expert id in a padding column (one count exchange, one wait for the host)."""
        t, h = x.shape
        group = self.group
        if self.dest_of.device != x.device:
            self.dest_of = self.dest_of.to(x.device)
        ids = routing.expert_ids.reshape(-1).long()  # [T * k]
        # Unit (pair, s) goes to EP-block offset owner * es + s: every slice gets the pair.
        s = torch.arange(self.es, device=x.device)
        dest = self.dest_of[((ids // self.e_local)[:, None] * self.es + s).reshape(-1)]  # [T * k * es]
        order = torch.sort(dest, stable=True).indices  # units grouped by destination
        counts = torch.zeros(group.size + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, dest, torch.ones_like(dest))
        send, recv = exchange_counts(counts[:group.size], group)
        order = order[:sum(send)]  # drops the units another TP rank sends
        self.sent_pairs = len(order)
        pair = order // self.es
        token = pair // self.top_k
        # Rows padded to a multiple of 16 bytes; the first padding column holds the expert
        # id's bits (the all-to-all only copies bytes, and NCCL moves no 16-bit integers).
        ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
        payload = torch.empty(len(order), h + 16 // x.element_size(), dtype=x.dtype, device=x.device)
        payload[:, :h] = x[token]
        payload.view(ints)[:, h] = ids[pair] % self.e_local
        received, _ = all_to_all(payload, send, group, recv_counts=recv)
        return Sent(received[:, :h], received.view(ints)[:, h:h + 1], recv, send, token,
                    routing.weights.reshape(-1)[pair].float(), group)

    @staticmethod
    def compute(sent: "Sent", experts) -> torch.Tensor:
        """This rank's experts on the rows it received (each routed to one local expert)."""
        if not sent.x.shape[0]:
            return sent.x
        ones = torch.ones(sent.x.shape[0], 1, device=sent.x.device)
        return experts.fused(sent.x, sent.expert.int(), ones)

    def combine(self, y: torch.Tensor, sent: "Sent", num_tokens: int) -> torch.Tensor:
        """Rows back to their senders (counts known from the dispatch), weighted sum per token
        in float32 (+ under PCC the all-reduce of the TP ranks' partial sums, in y's dtype)."""
        back, _ = all_to_all(y, sent.recv_counts, sent.group, recv_counts=sent.send_counts)
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, sent.token, back.float() * sent.weight[:, None])
        out = out.to(y.dtype)
        if self.pcc:
            all_reduce(out, self.groups.tp)  # each TP rank combined only its share of pairs
        return out

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        sent = self.dispatch(x, routing)
        return self.combine(self.compute(sent, experts), sent, x.shape[0])


@dataclass
class Sent:
    """What one rank received in the dispatch all-to-all, and how to undo it."""

    x: torch.Tensor  # [M, H] rows received, grouped by source rank (row stride H + padding)
    expert: torch.Tensor  # [M, 1] local expert of each received row
    recv_counts: list[int]  # rows from each source
    send_counts: list[int]  # rows this rank sent to each destination
    token: torch.Tensor  # [N] token of each sent row, in send order
    weight: torch.Tensor  # [N] combine weight of each sent row
    group: object  # the comm.Group of the all-to-all
