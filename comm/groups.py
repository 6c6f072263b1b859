"""Process groups built once from the parallel layout and handed to constructors.

Rank layout (pipeline stages outermost, then data-parallel replicas, tensor-parallel
ranks innermost, as in Megatron): rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
The expert dimension reuses the same ranks: expert-parallel groups are ``ep *
expert_slicing`` consecutive ranks, each expert sliced over ``expert_slicing`` consecutive
ranks; PCC groups join the ranks of one stage that share a TP index.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


# The job's process groups by their ranks. new_group is collective, and each group keeps its
# own connections and threads (gloo) or communicator and device buffers (NCCL) until the job's
# process group is destroyed: engines loaded one after another in one job share them, as
# every rank makes the same builds in the same order. bootstrap.shutdown forgets them.
_made: dict[tuple[int, ...], object] = {}


def _process_group(ranks: list[int]):
    key = tuple(ranks)
    if key not in _made:
        _made[key] = dist.new_group(ranks)
    return _made[key]


def forget_groups() -> None:
    """Drops the groups made so far: the job's process group is being destroyed."""
    _made.clear()


@dataclass
class Group:
    """One process group as seen from this rank."""

    group: object | None  # a torch ProcessGroup, or None when the group is this rank alone
    rank: int
    size: int
    ranks: tuple[int, ...]
    fast_sum: object | None = None  # a comm.collectives.SymmetricAllReduce for its small all-reduces

    @classmethod
    def alone(cls, rank: int = 0) -> "Group":
        return cls(None, 0, 1, (rank,))


@dataclass
class ParallelGroups:
    tp: Group  # tensor parallel: heads / FFN columns split, all-reduce after row-parallel layers
    dp: Group  # replicas of the dense part
    ep: Group  # expert parallel: experts placed over these ranks (all-to-all)
    expert_slice: Group  # ranks sharing the slices of one expert (reduction of its output)
    pcc: Group  # ranks of one stage with this rank's TP index (the PCC all-to-all)
    world_rank: int = 0
    pp: Group = field(default_factory=Group.alone)  # this rank's pipeline: one rank a stage, in stage order

    @classmethod
    def single(cls) -> "ParallelGroups":
        one = Group.alone()
        return cls(one, one, one, one, one)

    @classmethod
    def build(cls, parallel, world_rank: int, world_size: int) -> "ParallelGroups":
        """Every rank must call this with the same layout: torch creates groups collectively."""
        tp, dp, pp = parallel.tp, parallel.dp, parallel.pp
        ep, es = parallel.ep, parallel.expert_slicing
        if tp * dp * pp != world_size:
            raise ValueError(f"parallel: tp={tp} * dp={dp} * pp={pp} = {tp * dp * pp} ranks, "
                             f"but the job has {world_size}")
        if world_size % (ep * es):
            raise ValueError(f"parallel: ep={ep} * expert_slicing={es} must divide the {world_size} ranks")

        def blocks(size: int) -> list[list[int]]:
            return [list(range(s, s + size)) for s in range(0, world_size, size)]

        stage = tp * dp  # ranks of one pipeline stage
        if stage % (ep * es):
            raise ValueError(f"parallel: ep={ep} * expert_slicing={es} must divide the {stage} ranks of a "
                             f"pipeline stage (tp * dp)")

        # Ranks of one stage that share a TP index: the dense part's replicas, and the
        # PCC all-to-all's peers (p / L of them) - the same ranks, one group.
        same_tp_index = [[s + d * tp + i for d in range(dp)]
                         for s in range(0, world_size, tp * dp) for i in range(tp)]
        mine = {}
        pipelines = [[at + s * stage for s in range(pp)] for at in range(stage)]
        for name, lists in (("tp", blocks(tp)), ("dp", same_tp_index), ("ep", blocks(ep * es)),
                            ("expert_slice", blocks(es)), ("pp", pipelines)):
            for ranks in lists:
                # new_group is collective: every rank creates every group, in the same order.
                handle = _process_group(ranks) if len(ranks) > 1 else None
                if world_rank in ranks:
                    mine[name] = Group(handle, ranks.index(world_rank), len(ranks), tuple(ranks))
        tp_group = mine["tp"]
        for name in ("ep", "expert_slice"):  # the same ranks: one group object, one fast sum
            if mine[name].ranks == tp_group.ranks:
                mine[name] = tp_group
        if parallel.all_reduce == "auto" and dist.get_backend() == "nccl":
            from comm.collectives import SymmetricAllReduce

            # Every rank makes the same groups' fast sums, in the same order (symmetric
            # memory is set up collectively at a group's first sum).
            for group in {id(g): g for g in (tp_group, mine["ep"]) if g.size > 1}.values():
                group.fast_sum = SymmetricAllReduce(group)
        return cls(world_rank=world_rank, pcc=mine["dp"], **mine)
