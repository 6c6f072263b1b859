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
from kernels.layout.reference import TAG_INTS
from kernels.options import KernelOptions
from comm import Group, ParallelGroups, all_reduce, all_to_all, exchange_counts


class LocalDispatcher:
    """All experts on this device."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: float | None = None):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def capacity(self, num_tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None  # dropless
        return max(1, math.ceil(num_tokens * self.top_k / self.num_experts * self.capacity_factor))

    @staticmethod
    def waits_for_host(num_tokens: int) -> bool:
        """Whether a call over ``num_tokens`` tokens waits for the host (it cannot be
        captured in a CUDA graph): never, all experts are here."""
        return False

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        """x [T, H] and its Routing -> the weighted expert outputs [T, H]."""
        return experts.fused(x, routing.expert_ids, routing.weights, self.capacity(x.shape[0]),
                             routing.maps)


class SameTokensDispatcher(LocalDispatcher):
    """Experts spread over the ranks of ``group`` (``local`` = [first, end) of them here,
    whole or as a slice of their width) where those ranks hold the same tokens: a TP
    group, or replicas that run the same sequences. Nothing needs to move: each rank runs
    the local fused kernels on its experts (pairs of experts elsewhere masked: they read
    no weights) and one all-reduce adds the partial sums, as vLLM runs expert
    parallelism inside a TP group. An all-to-all would send every token to every expert
    rank twice over (once from each replica) for the same sum."""

    def __init__(self, num_experts: int, top_k: int, local: tuple[int, int], group: Group,
                 capacity_factor: float | None = None):
        super().__init__(num_experts, top_k, capacity_factor)
        self.group = group
        self.masked = local != (0, num_experts)
        self.first = local[0]  # the kernels take the model's expert ids and skip those not here

    def run(self, x: torch.Tensor, routing, experts, partial: torch.Tensor | None = None) -> torch.Tensor:
        """``partial``: another sum over the same ranks (a tensor-parallel shared expert's),
        added before the one all-reduce."""
        if not self.masked:
            out = super().run(x, routing, experts)
        else:
            out = experts.fused(x, routing.expert_ids, routing.weights, self.capacity(x.shape[0]), masked=True,
                                first_expert=self.first)
        return all_reduce(out if partial is None else out + partial, self.group)


PAD = 16  # columns after a row of the all-to-all payload: keeps rows 16-element aligned


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

    At most ``fixed_tokens`` tokens (decode sizes) go through fixed-capacity buffers: each
    peer gets T x k x es rows (all of this rank's units could go to one peer, so nothing is
    dropped), the rows no unit fills tagged as padding, so the all-to-alls' sizes are known
    without a host wait for the counts (as DeepEP's low-latency mode sends). Padding rows
    run through an expert the real rows use (``compute``) and are never read back.
    """

    def __init__(self, num_experts: int, top_k: int, ep: int, expert_slicing: int,
                 groups: ParallelGroups, pcc: bool, options: KernelOptions = KernelOptions(),
                 fixed_tokens: int = 0):
        self.e_local, self.top_k, self.ep, self.es = num_experts // ep, top_k, ep, expert_slicing
        self.fixed_tokens = fixed_tokens
        self.pdl = options.pdl
        self.groups = groups
        tp = groups.tp.size
        self.pcc = pcc and tp > 1
        if self.pcc and (ep * expert_slicing) % tp:
            raise ValueError(f"parallel.pcc: needs ep * expert_slicing to be a multiple of tp (got ep={ep}, "
                             f"expert_slicing={expert_slicing}, tp={tp}); use pcc: false")
        # Where each (expert, slice) unit goes, as an index into the all-to-all group; the
        # group size (a last, unsent bucket) marks units another TP rank sends under PCC.
        self.group = groups.pcc if self.pcc else groups.ep
        if self.pcc:
            where = {r: i for i, r in enumerate(groups.pcc.ranks)}
            dest_of = [where.get(r, groups.pcc.size) for r in groups.ep.ranks]
            if all(d in (groups.pcc.rank, groups.pcc.size) for d in dest_of):
                # The expert ranks lie inside this rank's TP group: what it sends stays here.
                # No peer takes part, and the replicas must not meet in a collective: they
                # may hold other prompts (other token counts, other numbers of calls).
                self.group = Group.alone(groups.world_rank)
                dest_of = [0 if d == groups.pcc.rank else 1 for d in dest_of]
        else:
            dest_of = list(range(groups.ep.size))
        # [E, es] table, on the CPU (the model may be built on the meta device) until first use.
        units = range(expert_slicing)
        self.dest_table = torch.tensor([[dest_of[e // self.e_local * expert_slicing + s] for s in units]
                                        for e in range(num_experts)], device="cpu")
        self._tables = {}  # device -> the table there
        self._sent: int | torch.Tensor = 0  # units sent in the last call (on the device where fixed)

    def waits_for_host(self, num_tokens: int) -> bool:
        """Whether a call over ``num_tokens`` tokens waits for the host (it cannot be
        captured in a CUDA graph): where the exchange takes exact sizes, which the host
        needs (also where this rank alone takes part: they size its buffers)."""
        return num_tokens > self.fixed_tokens

    def table(self, device: torch.device) -> torch.Tensor:
        if device not in self._tables:
            self._tables[device] = self.dest_table.to(device, torch.int32)
        return self._tables[device]

    @property
    def sent_pairs(self) -> int:
        """(pair, slice) units this rank sent in the last call, for checks (a host wait
        where the call used fixed buffers)."""
        return int(self._sent)

    def dispatch(self, x: torch.Tensor, routing, weighted_input: bool = False) -> "Sent":
        """The layout transform by destination rank (the maps kernel of the local path, over
        ranks instead of experts, then one kernel writing the send buffer), then one
        all-to-all of the rows, each carrying its local expert id in its padding: one count
        exchange and one host wait, or none with fixed buffers. ``weighted_input`` (Llama 4):
        each row goes out scaled by its pair's weight, and comes back to a plain sum."""
        t, h = x.shape
        group = self.group
        ints = TAG_INTS[x.element_size()]
        # [T, k * es] unit -> destination (index_select takes the int32 ids as they are)
        dest = self.table(x.device).index_select(0, routing.expert_ids.reshape(-1)).reshape(t, -1)
        offsets, rows = kernels.token_maps(dest, group.size + 1, pdl=self.pdl)  # units grouped by destination
        # Rows padded to a multiple of 16 elements (aligned for the expert GEMM); the first
        # padding column holds the expert id's bits (the all-to-all only copies bytes, and
        # NCCL moves no 16-bit integers).
        if t <= self.fixed_tokens:
            cap = dest.numel()  # each peer's share; units another TP rank sends land past them all
            rows = (dest * cap + rows - offsets.index_select(0, dest.reshape(-1)).view_as(dest)).int()
            send = recv = [cap] * group.size
            self._sent = offsets[group.size]
            # Zeros: a padding row's expert output must be finite (a combine may weigh it by 0).
            payload = torch.zeros((group.size + 1) * cap, h + PAD, dtype=x.dtype, device=x.device)
            payload.view(ints)[:, h].fill_(-1)  # padding, unless a unit's row overwrites it
        else:
            send, recv = exchange_counts(offsets[1:-1] - offsets[:-2], group)
            self._sent = sum(send)
            payload = torch.empty(dest.numel(), h + PAD, dtype=x.dtype, device=x.device)
        kernels.dispatch_rows(x, rows, routing.expert_ids, self.e_local, payload, pdl=self.pdl)
        weights = routing.weights.float()
        if self.es > 1:  # every slice returns a partial sum with the pair's weight
            weights = weights.repeat_interleave(self.es, dim=1)
        if weighted_input:
            at = rows.reshape(-1).long()
            payload[at, :h] = (payload[at, :h].float() * weights.reshape(-1, 1)).to(x.dtype)
            weights = torch.ones_like(weights)
        received, _ = all_to_all(payload[:sum(send)], send, group, recv_counts=recv)
        return Sent(received[:, :h], received.view(ints)[:, h:h + 1], recv, send, rows, weights, group,
                    padded=t <= self.fixed_tokens)

    @staticmethod
    def compute(sent: "Sent", experts) -> torch.Tensor:
        """This rank's experts on the rows it received, each routed to one local expert.
        A fixed buffer's padding rows (tagged -1, never read back) go to the largest expert
        id received, which the real rows read anyway (expert 0 where none is real): at
        decode sizes most rows are padding, and an expert of their own would add its
        weights' read to the step."""
        if not sent.x.shape[0]:
            return sent.x
        ones = torch.ones(sent.x.shape[0], 1, device=sent.x.device)
        expert = sent.expert.int()
        if sent.padded:
            expert = torch.where(expert < 0, expert.max().clamp(min=0), expert)
        return experts.fused(sent.x, expert, ones)

    def combine(self, y: torch.Tensor, sent: "Sent") -> torch.Tensor:
        """Rows back to their senders (counts known from the dispatch), then the gather
        kernel's weighted sum per token, accumulated in float32 (+ under PCC the all-reduce
        of the TP ranks' partial sums)."""
        back, _ = all_to_all(y, sent.recv_counts, sent.group, recv_counts=sent.send_counts)
        out = kernels.gather_rows(back, sent.rows, sent.weight, limit=sent.sent_rows, pdl=self.pdl)
        if self.pcc:
            all_reduce(out, self.groups.tp)  # each TP rank combined only its share of pairs
        return out

    def run(self, x: torch.Tensor, routing, experts) -> torch.Tensor:
        sent = self.dispatch(x, routing, getattr(experts, "weighted_input", False))
        return self.combine(self.compute(sent, experts), sent)


@dataclass
class Sent:
    """What one rank received in the dispatch all-to-all, and how to undo it."""

    x: torch.Tensor  # [M, H] rows received, grouped by source rank (row stride H + padding)
    expert: torch.Tensor  # [M, 1] local expert of each received row
    recv_counts: list[int]  # rows from each source
    send_counts: list[int]  # rows this rank sent to each destination
    rows: torch.Tensor  # [T, k * es] send-buffer row of each (pair, slice) unit
    weight: torch.Tensor  # [T, k * es] combine weight of each unit
    group: object  # the comm.Group of the all-to-all
    padded: bool = False  # fixed-capacity buffers: rows tagged -1 are padding

    @property
    def sent_rows(self) -> int:
        """Send-buffer rows that were sent; rows past them hold another TP rank's units."""
        return sum(self.send_counts)
