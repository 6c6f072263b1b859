"""Pipeline stages' inference schedule (``moe_infer.pipeline``) on a simulated clock: the
bubble of the re-queueing schedule and of the drain-every-token baseline against their
closed forms, and slots that last as long as their slowest stage."""
import pytest

from moe_infer.config import ConfigError, ParallelConfig
from moe_infer.pipeline import simulate, split


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_bubble_matches_its_closed_form(stages, groups, tokens):
    """M micro-batches of K equal units through P stages: micro-batch g's unit k enters
    the first stage at slot g + k max(M, P), so the run takes K max(M, P) + min(M, P) - 1
    slots, each stage busy M K of them."""
    tl = simulate(stages, [[1.0] * tokens for _ in range(groups)])
    slots = tokens * max(groups, stages) + min(groups, stages) - 1
    assert tl.slots == slots and tl.wall == slots
    assert tl.busy == [groups * tokens] * stages
    assert tl.bubble == pytest.approx(1 - groups * tokens / slots)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_requeueing_nearly_fills_the_pipeline_where_draining_idles_all_but_one_stage(stages):
    tokens = 128
    requeued = simulate(stages, [[1.0] * tokens] * stages).bubble
    drained = simulate(stages, [[1.0] * tokens]).bubble
    assert requeued <= (stages - 1) / (stages * tokens) + 1e-12 and requeued < 0.1
    assert drained == pytest.approx(1 - 1 / stages)


def test_a_slot_lasts_as_long_as_its_slowest_stage():
    # Two stages, a long unit then a short one of another micro-batch: in slot 1 stage 0
    # runs the short one (1) and stage 1 the long one (3): the slot takes 3.
    tl = simulate(2, [[3.0], [1.0]])
    assert tl.slots == 3 and tl.wall == 3.0 + 3.0 + 1.0
    assert tl.busy == [4.0, 4.0]


def test_split_keeps_order_and_evens_sizes():
    assert split(list(range(7)), 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert split([0, 1], 4) == [[0], [1]]
    assert split([5], 1) == [[5]]


def test_micro_batch_counts_default_from_the_stages_and_must_be_positive():
    p = ParallelConfig(pp=3, dp=1)
    assert (p.micro_batches, p.prompt_micro_batches) == (3, 12)
    with pytest.raises(ConfigError, match="parallel.micro_batches"):
        ParallelConfig(pp=2, micro_batches=0)
