"""The cost model's closed forms (``moe_infer.costmodel``): the distinct experts a batch
hits (uniform or a measured routing; the busiest expert-parallel rank's), the collectives'
alpha-beta times over a link where the hardware profile has no measured table, and the
pipeline schedule's slot count."""
from __future__ import annotations

import functools
import math

from moe_infer.hardware_profile import GB, Link


def distinct_experts(num_experts: int, top_k: int, tokens: float, local: int | None = None,
                     histogram: list[float] | None = None) -> float:
    """Expected number of distinct experts among ``local`` of them (default all) that
    ``tokens`` tokens hit, each picking ``top_k`` distinct experts: uniformly (each expert
    missed by a token with probability 1 - k / E), or with ``histogram`` (the first
    ``local`` entries are this rank's experts). A histogram of whole pick counts whose sum
    is a multiple of k (``moe_infer.routing``: N tokens counted) gives the experts a random
    ``tokens`` of those N tokens hit (an expert c of them picked is missed with probability
    C(N - c, tokens) / C(N, tokens)), and beyond N the experts they picked; any other
    histogram is each expert's share of the picks, every token drawn from them alone."""
    local = num_experts if local is None else local
    if histogram is None:
        return local * (1.0 - (1.0 - top_k / num_experts) ** tokens)
    total = sum(histogram)
    counted = total / top_k
    if counted == int(counted) and all(h == int(h) and h <= counted for h in histogram):
        return sum(1.0 - _missed(counted, h, tokens) for h in histogram[:local])
    return sum(1.0 - (1.0 - min(1.0, top_k * h / total)) ** tokens for h in histogram[:local])


def _missed(counted: float, picked: float, tokens: float) -> float:
    """The chance that ``tokens`` of ``counted`` tokens drawn without replacement miss all
    ``picked`` of them: C(counted - picked, tokens) / C(counted, tokens)."""
    if picked == 0:
        return 1.0
    if tokens > counted - picked:
        return 0.0
    lg = math.lgamma
    return math.exp(lg(counted - picked + 1) - lg(counted - picked - tokens + 1) - lg(counted + 1)
                    + lg(counted - tokens + 1))


@functools.lru_cache(maxsize=1024)
def busiest_rank_experts(num_experts: int, top_k: int, tokens: int, ranks: int, samples: int = 4000) -> float:
    """Expected distinct experts the busiest of ``ranks`` ranks (E / ranks experts each)
    reads for ``tokens`` tokens under uniform routing: the rank every other waits for at
    the next collective. A seeded Monte-Carlo count where few tokens make ranks uneven;
    where the tokens hit nearly every expert, the mean (``distinct_experts``)."""
    local = num_experts // ranks
    if ranks == 1 or tokens * top_k >= 4 * num_experts:
        return distinct_experts(num_experts, top_k, tokens, local)
    import torch

    gen = torch.Generator().manual_seed(0)
    picks = torch.rand(samples, tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices  # [S, T, k]
    hit = torch.zeros(samples, num_experts, dtype=torch.bool)
    hit.scatter_(1, picks.reshape(samples, -1), True)
    return hit.view(samples, ranks, local).sum(-1).max(-1).values.double().mean().item()


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """A sum over ``ranks``, in the shortest of three forms: one-shot (each rank reads every
    peer's copy: one latency, (p - 1) n bytes in), the ring (2 (p - 1) steps of n / p
    bytes) and the tree (a reduce and a broadcast, 2 ceil(log2 p) steps of n bytes: NCCL's
    choice for small sums over many ranks)."""
    if ranks <= 1:
        return 0.0
    one_shot = link.alpha_us * 1e-6 + (ranks - 1) * nbytes / (link.gbps * GB)
    ring = 2 * (ranks - 1) * link.seconds(nbytes / ranks)
    tree = 2 * math.ceil(math.log2(ranks)) * link.seconds(nbytes)
    return min(one_shot, ring, tree)


def all_to_all_s(nbytes: float, ranks: int, link: Link) -> float:
    """Each rank sends ``nbytes`` spread evenly over the ``ranks`` (its own share stays)."""
    if ranks <= 1:
        return 0.0
    return link.alpha_us * 1e-6 * (ranks - 1) + (ranks - 1) / ranks * nbytes / (link.gbps * GB)


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    """Each rank's ``nbytes`` to every other rank, around a ring: p - 1 steps of one part."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.seconds(nbytes)


CLOSED_FORMS = {"all_reduce": all_reduce_s, "all_reduce_nccl": all_reduce_s, "all_gather": all_gather_s,
                "all_to_all": all_to_all_s}


def pipeline_slots(stages: int, micro_batches: int, units: int) -> int:
    """Slots the schedule of ``moe_infer.pipeline`` takes for ``micro_batches`` groups of
    ``units`` equal units each: K max(M, P) + min(M, P) - 1."""
    return units * max(micro_batches, stages) + min(micro_batches, stages) - 1
