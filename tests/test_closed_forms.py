"""The cost model's closed forms (``moe_infer.closed_forms``, ``moe_infer.palm``) against
hand-computed cases, a Monte-Carlo count and every subset of a few tokens: the distinct
experts a batch hits, the collectives over a link, the pipeline schedule's slots, the PaLM
layouts' FFN communication."""
import random

import pytest

from moe_infer.closed_forms import all_reduce_s, all_to_all_s, distinct_experts, pipeline_slots
from moe_infer.config import ConfigError
from moe_infer.hardware_profile import Link
from moe_infer.pipeline import simulate


@pytest.mark.parametrize("e,k,t", [(8, 2, 1), (8, 2, 5), (64, 8, 3), (128, 8, 64)])
def test_distinct_experts_matches_a_monte_carlo_count(e, k, t):
    rng = random.Random(e * 1000 + t)
    trials = 4000
    seen = sum(len({x for _ in range(t) for x in rng.sample(range(e), k)}) for _ in range(trials)) / trials
    assert distinct_experts(e, k, t) == pytest.approx(seen, rel=0.02)
    # a rank holding a quarter of them sees a quarter
    assert distinct_experts(e, k, t, local=e // 4) == pytest.approx(distinct_experts(e, k, t) / 4)


def test_distinct_experts_follows_a_routing_histogram():
    # every pick on the first two of eight experts: two distinct whatever the tokens
    hist = [0.5, 0.5] + [0.0] * 6
    assert distinct_experts(8, 2, 50, histogram=hist) == pytest.approx(2.0)
    assert distinct_experts(8, 2, 50, local=4, histogram=[0, 0, 0, 0] + [0.5, 0.5, 0, 0]) == 0.0
    assert distinct_experts(8, 2, 3, histogram=[0.125] * 8) == pytest.approx(distinct_experts(8, 2, 3))


def test_distinct_experts_of_pick_counts_are_those_a_subset_of_the_counted_tokens_hits():
    """Whole pick counts (``moe-infer routing``): N tokens counted; T of them drawn without
    replacement hit what they picked, checked against every subset of tokens picking
    (0, 3), (0, 3), (0, 1) of four experts; at or past N, the experts picked."""
    import itertools

    tokens = [(0, 3), (0, 3), (0, 1)]
    counts = [3, 1, 0, 2]
    for t in (1, 2, 3):
        subsets = [len({e for tok in sub for e in tok}) for sub in itertools.combinations(tokens, t)]
        assert distinct_experts(4, 2, t, histogram=counts) == pytest.approx(sum(subsets) / len(subsets))
    assert distinct_experts(4, 2, 50, histogram=counts) == pytest.approx(3.0)
    assert distinct_experts(4, 2, 2, local=2, histogram=counts) == pytest.approx(1 + 2 / 3)
    # every expert picked once by four tokens: three of them hit six of eight
    assert distinct_experts(8, 2, 3, histogram=[1] * 8) == pytest.approx(6.0)


def test_collectives_by_hand():
    link = Link(alpha_us=5.0, gbps=100.0)
    # large: the ring, 2 (p - 1) steps of n / p bytes: 6 x (5 us + 1 GB / 100 GB/s)
    assert all_reduce_s(4e9, 4, link) == pytest.approx(6 * (5e-6 + 0.01))
    # small: one-shot, one latency and (p - 1) n bytes in
    assert all_reduce_s(1e3, 4, link) == pytest.approx(5e-6 + 3e3 / 1e11)
    assert all_reduce_s(1e9, 1, link) == 0.0
    # small over many ranks: the tree, 2 log2(p) steps of n bytes, beats 2 (p - 1) latencies
    assert all_reduce_s(1e5, 256, link) == pytest.approx(16 * (5e-6 + 1e5 / 1e11))
    # all-to-all: (p - 1) messages, (p - 1) / p of the bytes leave
    assert all_to_all_s(8e9, 4, link) == pytest.approx(3 * 5e-6 + 0.75 * 8e9 / 1e11)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4, 5])
@pytest.mark.parametrize("units", [1, 7])
def test_pipeline_slots_is_the_schedules_count(stages, groups, units):
    assert pipeline_slots(stages, groups, units) == simulate(stages, [[1.0] * units] * groups).slots


def test_palm_communication_closed_forms():
    """The PaLM inference paper's FFN communication (its appendix A), by hand: 1D
    weight-stationary 2 BLE / bw whatever the chips; 2D 8 BLE / (sqrt(n) bw), so 2D beats
    1D past 16 chips; weight-gathered 4 E sqrt(BLF) / (sqrt(n) bw), cheaper than 2D once
    BL exceeds 4 F."""
    from moe_infer.palm import PALM, palm_ffn_comm_s

    s = PALM["palm-540b"]
    e, f = s.width, s.ffn
    assert s.params == pytest.approx(558e9, rel=0.01)  # 540B, heads padded from 48 to 64 (~3%)
    bl, bw = 64, 100.0
    one = palm_ffn_comm_s("1d-weight-stationary", s, bl, 64, bw)
    assert one == pytest.approx(2 * bl * e * 2 / 1e11) == palm_ffn_comm_s("1d-weight-stationary", s, bl, 256, bw)
    two = palm_ffn_comm_s("2d-weight-stationary", s, bl, 64, bw)
    assert two == pytest.approx(8 * bl * e * 2 / (8 * 1e11)) and two / one == pytest.approx(4 / 8)
    big = 512 * 2048
    wg = palm_ffn_comm_s("weight-gathered", s, big, 64, bw)
    assert wg == pytest.approx(4 * e * (big * f) ** 0.5 * 2 / (8 * 1e11))
    assert (wg < palm_ffn_comm_s("2d-weight-stationary", s, big, 64, bw)) == (big > 4 * f)
    with pytest.raises(ConfigError, match="expected one of"):
        palm_ffn_comm_s("3d", s, bl, 64, bw)
