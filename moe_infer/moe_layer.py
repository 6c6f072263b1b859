"""The MoE feed-forward layer: route -> dispatch -> experts -> combine (+ shared experts).

Shape letters: T tokens, H hidden. Only the dispatcher communicates (expert parallelism);
the shared expert's row-parallel projection ends in its TP all-reduce. Under expert
parallelism the shared experts run on a second stream while the routed experts' collectives
run.
"""
from __future__ import annotations

import torch
from torch import nn

from comm import ParallelGroups
from dense.mlp import MLP
from kernels.options import KernelOptions
from kernels.routing.reference import MAX_K
from moe_infer.dispatch import ExpertParallelDispatcher, LocalDispatcher, SameTokensDispatcher
from moe_infer.experts import Experts
from moe_infer.gating import Router


class MoELayer(nn.Module):
    def __init__(self, model_cfg, moe_cfg, parallel=None, groups: ParallelGroups | None = None,
                 options: KernelOptions = KernelOptions()):
        super().__init__()
        h = model_cfg.hidden_size
        groups = groups or ParallelGroups.single()
        ep, es = (parallel.ep, parallel.expert_slicing) if parallel is not None else (1, 1)
        # Expert ranks that hold the same tokens (a TP group, or replicas that run the same
        # sequences: all but data-parallel attention): nothing moves, an all-reduce sums.
        same_tokens = ep * es > 1 and (not parallel.dp_attention or set(groups.ep.ranks) <= set(groups.tp.ranks))
        local = ep * es == 1 or (same_tokens and ep == 1)  # every expert here (maybe sliced): its maps
        # With a capacity the maps depend on it: the dispatcher builds them, not the router;
        # with expert parallelism the maps are built per destination rank instead.
        groups_ = (moe_cfg.n_group, moe_cfg.topk_group, moe_cfg.routed_scaling_factor,
                   moe_cfg.group_score == "max") if moe_cfg.grouped else None
        self.router = Router(h, moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.score, moe_cfg.renormalize,
                             with_maps=moe_cfg.capacity_factor is None and local, options=options, groups=groups_,
                             score_bias=moe_cfg.score_bias, bias=moe_cfg.router_bias)
        self.local_dropless = moe_cfg.capacity_factor is None and local
        self.options = options
        self._maps_at: dict = {}  # _maps_needed's answers
        ep_index = groups.ep.rank // es
        self.experts = Experts(moe_cfg.num_experts, h, moe_cfg.expert_hidden, model_cfg.activation,
                               ep_index, ep, groups.ep.rank % es, es, options, bias=moe_cfg.expert_bias,
                               weighted_input=moe_cfg.weighted_input)
        if same_tokens:
            self.dispatcher = SameTokensDispatcher(moe_cfg.num_experts, moe_cfg.top_k, self.experts.expert_range,
                                                   groups.ep, moe_cfg.capacity_factor)
        elif ep * es > 1:
            self.dispatcher = ExpertParallelDispatcher(moe_cfg.num_experts, moe_cfg.top_k, ep, es, groups,
                                                       parallel.pcc, options, parallel.a2a_fixed_tokens)
        else:
            self.dispatcher = LocalDispatcher(moe_cfg.num_experts, moe_cfg.top_k, moe_cfg.capacity_factor)
        self.shared = None
        self.shared_gate = None
        if moe_cfg.shared_experts:
            # n shared experts of width F are one MLP of width n * F: the sum is the same.
            width = moe_cfg.shared_experts * moe_cfg.shared_expert_hidden
            self.shared = MLP(h, width, model_cfg.activation, tp=groups.tp, options=options)
            if moe_cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(h, 1, bias=False)
        # The shared expert's TP partial sum joins the routed experts' before their one
        # all-reduce where both sum over the same ranks (a gate on replicated x scales each
        # partial alike): one collective a layer instead of two.
        self.fused_sum = (self.shared is not None and isinstance(self.dispatcher, SameTokensDispatcher)
                          and groups.tp.size > 1 and self.dispatcher.group.ranks == groups.tp.ranks)
        # Where the routed experts' sum crosses ranks (an all-to-all, or the all-reduce over
        # replicas) and the shared MLP is whole here, the shared MLP does not wait for it: it
        # runs on a second stream meanwhile (a collective leaves most of the device idle).
        # Not where tensor parallelism splits it: its own all-reduce would meet the
        # dispatcher's collectives in an order the ranks need not share.
        self.overlap = (self.shared is not None and not self.fused_sum and ep * es > 1 and groups.tp.size == 1
                        and options.overlap_shared_experts)
        self._side: dict = {}  # device -> the shared MLP's stream

    def fold_shared(self) -> bool:
        """Moves the shared experts into the routed experts' weights, as n more experts of
        the routed width after the E routed ones (n shared experts of width F are n such
        experts; the sum is the same), and makes the router name them in every token's table
        with weight 1: one pass of the fused MoE kernels then runs both, where it took two
        launches for the shared MLP, two for the routed experts and an add. -> whether it
        did. Only where the layer's experts all run here on whole, plain weights (no expert
        parallelism or slicing, no tensor-parallel shared MLP, no capacity, no shared gate,
        not offloaded or quantized yet, no biases), the shared width a multiple of the routed
        one, and, on a GPU, where the free memory holds the new weights beside the old ones
        (they are copied, then the old freed). ``KernelOptions.fold_shared_experts`` False:
        never (an A/B baseline)."""
        shared, experts = self.shared, self.experts
        if (shared is None or self.shared_gate is not None or not self.options.fold_shared_experts
                or type(self.dispatcher) is not LocalDispatcher or self.dispatcher.capacity_factor is not None
                or type(experts) is not Experts or experts.b13 is not None or shared.tp.size > 1):
            return False
        up, down = shared.up_proj, shared.down_proj
        if (getattr(up, "bias", None) is not None or getattr(down, "bias", None) is not None
                or up.weight.dtype != experts.w13.dtype or down.weight.dtype != experts.w2.dtype
                or up.weight.device != experts.w13.device):
            return False
        f, width = experts.w2.shape[2], down.weight.shape[1]
        n = width // f
        if width % f or self.router.top_k + n > MAX_K:
            return False
        new_bytes = (experts.w13.numel() + experts.w2.numel() + up.weight.numel() + down.weight.numel()) \
            * experts.w13.element_size()
        if experts.w13.is_cuda and torch.cuda.mem_get_info(experts.w13.device)[0] < new_bytes:
            return False
        h = experts.w13.shape[2]
        with torch.no_grad():
            if experts.w13.shape[1] == 2 * f:  # gated: shared expert j's gate rows, then its up rows
                gate, upw = up.weight.view(2, n, f, h)
                w13 = torch.cat([gate, upw], dim=1)  # [n, 2F, H]
            else:
                w13 = up.weight.view(n, f, h)
            w2 = down.weight.view(h, n, f).permute(1, 0, 2)  # [n, H, F]: expert j's columns of the down weight
            experts.w13 = nn.Parameter(torch.cat([experts.w13, w13]), requires_grad=False)
            experts.w2 = nn.Parameter(torch.cat([experts.w2, w2]), requires_grad=False)
        experts.expert_range = (experts.expert_range[0], experts.expert_range[1] + n)
        self.shared = None
        self.router.shared = n
        self._maps_at.clear()
        return True

    def _maps_needed(self, x: torch.Tensor) -> bool:
        """Whether the router should build the maps: not where the local experts run from
        the routing ids alone (decode sizes on a GPU), where routing is then the gating
        launch by itself. Decided once per (T, dtype, device, expert weights' dtype)."""
        if not self.local_dropless:
            return True
        key = (x.shape[0], x.dtype, x.device, self.experts.w13.dtype)
        needed = self._maps_at.get(key)
        if needed is None:
            needed = self._maps_at[key] = not self.experts.pairs_from_ids(x, self.router.slots)
        return needed

    def _shared_out(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The shared experts' output on x [T, H] (``reduce`` False: this rank's TP part)."""
        shared = self.shared(x, reduce=reduce)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return shared

    def _run_overlapped(self, x: torch.Tensor, routing) -> torch.Tensor:
        """The routed experts and their collectives on this stream, the shared MLP on a
        second one; they join before the add (inside a CUDA graph capture the fork and the
        join become the graph's edges)."""
        main = torch.cuda.current_stream(x.device)
        side = self._side.get(x.device)
        if side is None:
            side = self._side[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            shared = self._shared_out(x)
        out = self.dispatcher.run(x, routing, self.experts)
        main.wait_stream(side)
        shared.record_stream(main)  # made on the side stream, read and freed on this one
        return out + shared

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. ``router_logits``: already computed (the decode step's
        norm + router launch)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        routing = self.router(x, router_logits, maps=self._maps_needed(x))
        if self.fused_sum:
            partial = self._shared_out(x, reduce=False)
            return self.dispatcher.run(x, routing, self.experts, partial=partial).view(shape)
        if self.overlap and x.is_cuda:
            return self._run_overlapped(x, routing).view(shape)
        out = self.dispatcher.run(x, routing, self.experts)  # [T, H]
        if self.shared is not None:
            out = out + self._shared_out(x)
        return out.view(shape)
