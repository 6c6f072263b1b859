"""The MoE feed-forward layer: route -> dispatch -> experts -> combine (+ shared experts).

Shape letters: T tokens, H hidden. Only the dispatcher communicates (expert parallelism);
the shared expert's row-parallel projection ends in its TP all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from comm import ParallelGroups
from dense.mlp import MLP
from kernels.options import KernelOptions
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

    def _maps_needed(self, x: torch.Tensor) -> bool:
        """Whether the router should build the maps: not where the local experts run from
        the routing ids alone (decode sizes on a GPU), where routing is then the gating
        launch by itself. Decided once per (T, dtype, device, expert weights' dtype)."""
        if not self.local_dropless:
            return True
        key = (x.shape[0], x.dtype, x.device, self.experts.w13.dtype)
        needed = self._maps_at.get(key)
        if needed is None:
            needed = self._maps_at[key] = not self.experts.pairs_from_ids(x, self.router.top_k)
        return needed

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. ``router_logits``: already computed (the decode step's
        norm + router launch)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        routing = self.router(x, router_logits, maps=self._maps_needed(x))
        if self.fused_sum:
            shared = self.shared(x, reduce=False)  # this rank's part
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            return self.dispatcher.run(x, routing, self.experts, partial=shared).view(shape)
        out = self.dispatcher.run(x, routing, self.experts)  # [T, H]
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out.view(shape)
