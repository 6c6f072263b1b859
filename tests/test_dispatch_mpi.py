"""The multi-rank MoE layer's pieces against one process: the expert-parallel dispatch
(exact sizes and fixed-capacity buffers, PCC and naive), expert ranks that hold the same
tokens, and the vocabulary-parallel head. Run under mpirun with 2 and 4 ranks, as
``tests/test_model_mpi.py`` (scripts/test.sh on CPU with gloo; on GPUs
scripts/launch.sh -n 4 -- python -m pytest -m mpi tests/test_dispatch_mpi.py).
"""
import pytest
import torch
import torch.distributed as dist

from comm import Group
from dense.parallel_linear import VocabParallelHead
from moe_infer import ParallelConfig
from moe_infer.dispatch import ExpertParallelDispatcher
from moe_infer.gating import Routing
from moe_infer.moe_layer import MoELayer
from parity import rel_err

pytestmark = pytest.mark.mpi


class _Identity:
    """Experts that return their input: dispatch then combine must give back x."""

    def fused(self, x, ids, weights, capacity=None, maps=None):
        return x


def test_vocab_parallel_head_gives_the_whole_heads_logits_also_in_int8(info, world):
    """Each rank's ceil(V / P) rows of the head (a vocabulary P does not divide: the last
    rank's tail is zero) and one all-gather give the whole head's logits; as int8 (per-row
    scales: the same rows quantize alike) they equal the whole int8 head's."""
    from dense.parallel_linear import Linear
    from dense.quant import Int8Linear

    torch.manual_seed(3)
    vocab, hidden = 4 * world + 3, 24
    whole = Linear(hidden, vocab, bias=False).to(info.device)
    group = Group(dist.group.WORLD, dist.get_rank(), world, tuple(range(world)))
    head = VocabParallelHead(hidden, vocab, group).to(info.device)
    with torch.no_grad():
        head.weight.copy_(head.shard_fns["weight"](whole.weight))
    x = torch.randn(2, 3, hidden, device=info.device)
    with torch.no_grad():  # as the engine runs it
        torch.testing.assert_close(head(x), whole(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(Int8Linear(head)(x), Int8Linear(whole)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "fixed"])
@pytest.mark.parametrize("pcc", [False, True])
def test_dispatch_then_combine_restores_input_and_pcc_sends_less(info, pcc, fixed, monkeypatch):
    """Exact sizes (counts exchanged first) and fixed-capacity buffers (no count exchange:
    the padding rows are tagged, computed and never read back) give back every token."""
    from comm import ParallelGroups
    import moe_infer.dispatch as dispatch

    world = info.world_size
    tp = 2
    layout = ParallelConfig(tp=tp, dp=world // tp, ep=world, pcc=pcc)
    groups = ParallelGroups.build(layout, dist.get_rank(), world)
    t, e, k = 11, 8, 3
    gen = torch.Generator().manual_seed(5)  # the same tokens on every rank, as after a TP layer
    x = torch.randn(t, 16, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=gen)
    weights /= weights.sum(-1, keepdim=True)
    d = ExpertParallelDispatcher(e, k, world, 1, groups, pcc, fixed_tokens=t if fixed else 0)
    x, ids, weights = x.to(info.device), ids.to(info.device), weights.to(info.device)
    if fixed:
        monkeypatch.setattr(dispatch, "exchange_counts", lambda *a: pytest.fail("counts exchanged"))
    out = d.run(x, Routing(ids, weights), _Identity())
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-6)
    sent = torch.tensor([d.sent_pairs], device=info.device)
    dist.all_reduce(sent, group=groups.tp.group)
    # PCC: each (token, expert) pair once per TP group; naive: once per TP rank (L times).
    assert sent.item() == (t * k if pcc else tp * t * k)


@pytest.mark.parametrize("fixed", [False, True], ids=["exact", "fixed"])
def test_replicas_that_split_the_prompts_meet_in_no_dispatch(info, fixed):
    """tp2 x dp2, ep2, PCC: the expert ranks lie inside each TP group, so a rank's units
    stay in it, and the replicas (which split the prompts: other tokens, other numbers of
    MoE calls) share no collective in the dispatch."""
    from comm import ParallelGroups

    if info.world_size != 4:
        pytest.skip("needs 4 ranks: two replicas of a TP pair")
    groups = ParallelGroups.build(ParallelConfig(tp=2, dp=2, ep=2, pcc=True), dist.get_rank(), 4)
    d = ExpertParallelDispatcher(8, 3, 2, 1, groups, True, fixed_tokens=64 if fixed else 0)
    assert d.group.size == 1
    replica = groups.dp.rank
    gen = torch.Generator().manual_seed(replica)  # the TP pair's tokens, the other replica's differ
    for _ in range(1 + replica):
        t = 5 + 6 * replica
        x = torch.randn(t, 16, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(t)]).int()
        weights = torch.rand(t, 3, generator=gen)
        weights /= weights.sum(-1, keepdim=True)
        x, ids, weights = x.to(info.device), ids.to(info.device), weights.to(info.device)
        torch.testing.assert_close(d.run(x, Routing(ids, weights), _Identity()), x, rtol=1e-5, atol=1e-6)


def test_pcc_exchange_rejects_expert_ranks_that_do_not_align_with_tp(world):
    from comm import ParallelGroups

    if world < 4:  # with 2 ranks every EP layout (ep * slicing in {1, 2}) aligns with tp = 2
        pytest.skip("needs 4 ranks: expert blocks that straddle TP groups")
    layout = ParallelConfig(tp=world, dp=1, ep=world // 2, expert_slicing=1, pcc=True)
    groups = ParallelGroups.build(layout, dist.get_rank(), world)
    with pytest.raises(ValueError, match=r"parallel\.pcc: needs ep \* expert_slicing to be a multiple of tp"):
        ExpertParallelDispatcher(4, 2, world // 2, 1, groups, pcc=True)


def test_expert_ranks_with_the_same_tokens_all_reduce_instead_of_exchanging(info, world):
    """Without data-parallel attention the expert ranks hold the same tokens: each runs its
    own experts (the others' pairs masked) and an all-reduce sums, against one process
    running every expert; dp-attention keeps the all-to-all."""
    from comm import ParallelGroups
    from moe_infer.config import MoEConfig, ModelConfig
    from moe_infer.dispatch import SameTokensDispatcher

    m = ModelConfig(vocab_size=16, hidden_size=32, num_layers=1, num_heads=4, ffn_hidden=16)
    moe = MoEConfig(num_experts=8, top_k=3, expert_hidden=16)
    torch.manual_seed(0)  # every rank the same weights and tokens
    alone = MoELayer(m, moe).to(info.device)
    for p in alone.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(5, 32, device=info.device)
    ref = alone(x)
    for kw in (dict(dp=world, ep=world), dict(dp=world, ep=world // 2, expert_slicing=2),
               dict(dp=world, ep=1, expert_slicing=world)):
        layout = ParallelConfig(tp=1, **kw)
        layer = MoELayer(m, moe, layout, ParallelGroups.build(layout, dist.get_rank(), world)).to(info.device)
        assert isinstance(layer.dispatcher, SameTokensDispatcher), kw
        state = {k: v for k, v in alone.state_dict().items()}
        for name, fn in layer.experts.shard_fns.items():
            state[f"experts.{name}"] = fn(state[f"experts.{name}"])
        layer.load_state_dict(state)
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5, msg=str(kw))
    layout = ParallelConfig(tp=1, dp=world, ep=world, dp_attention=True)
    layer = MoELayer(m, moe, layout, ParallelGroups.build(layout, dist.get_rank(), world))
    assert isinstance(layer.dispatcher, ExpertParallelDispatcher)
    # A gated shared expert under tensor parallelism: its partial sum joins the routed
    # experts' before the one all-reduce (int8 linear layers too).
    from dense.quant import quantize_linears

    shared = MoEConfig(num_experts=8, top_k=3, expert_hidden=16, shared_experts=1, shared_expert_hidden=32,
                       shared_expert_gate=True)
    torch.manual_seed(1)
    alone = MoELayer(m, shared).to(info.device)
    for p in alone.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layout = ParallelConfig(tp=world)
    layer = MoELayer(m, shared, layout, ParallelGroups.build(layout, dist.get_rank(), world)).to(info.device)
    assert layer.fused_sum
    state = dict(alone.state_dict())
    for module, prefix in ((layer.experts, "experts."), (layer.shared.up_proj, "shared.up_proj."),
                           (layer.shared.down_proj, "shared.down_proj.")):
        for name, fn in module.shard_fns.items():
            if prefix + name in state:
                state[prefix + name] = fn(state[prefix + name])
    layer.load_state_dict(state)
    ref = alone(x)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
    quantize_linears(layer)
    assert rel_err(layer(x), ref) < 5e-2
