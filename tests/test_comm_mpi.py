"""Multi-rank tests, run under mpirun with 2 and 4 ranks: gloo on CPU (scripts/test.sh
does), NCCL on GPUs (tensors live on each rank's device):

    mpiexec -n 4 python -m pytest -m mpi tests/test_comm_mpi.py
    scripts/launch.sh -n 4 -- python -m pytest -m mpi tests/test_comm_mpi.py

Every rank runs every test; collectives must agree across ranks, so no test may be
skipped on some ranks only.
"""
import pytest
import torch
from torch import nn

from comm import Group, ParallelGroups, all_gather, all_reduce, all_to_all
from dense.parallel_linear import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.mpi


class Layout:
    def __init__(self, tp, dp, ep=1, expert_slicing=1, pp=1, all_reduce="auto"):
        self.tp, self.dp, self.ep, self.expert_slicing, self.pp = tp, dp, ep, expert_slicing, pp
        self.all_reduce = all_reduce


@pytest.fixture(autouse=True)
def on_rank_device(info):
    """Tensors made in a test live on the rank's device: NCCL moves only those on its GPU."""
    with torch.device(info.device):
        yield


def test_group_layout(info):
    w, r = info.world_size, info.rank
    g = ParallelGroups.build(Layout(tp=2, dp=w // 2, ep=2), r, w)
    assert g.tp.ranks == (r - r % 2, r - r % 2 + 1) and g.tp.rank == r % 2
    assert g.dp.ranks == tuple(range(r % 2, w, 2)) and g.pcc is g.dp  # PCC peers: same TP index
    assert g.ep.size == 2 and g.expert_slice.size == 1
    with pytest.raises(ValueError, match=rf"tp={2 * w} \* dp=1 \* pp=1 = {2 * w} ranks, but the job has {w}"):
        ParallelGroups.build(Layout(tp=2 * w, dp=1), r, w)


def test_all_reduce_and_all_gather(info):
    g = ParallelGroups.build(Layout(tp=info.world_size, dp=1), info.rank, info.world_size).tp
    x = torch.full((3,), float(info.rank + 1))
    assert torch.equal(all_reduce(x.clone(), g), torch.full((3,), float(sum(range(1, g.size + 1)))))
    got = all_gather(torch.tensor([[info.rank, 10 + info.rank]]), g, dim=0)
    assert got.tolist() == [[i, 10 + i] for i in range(g.size)]
    got = all_gather(torch.tensor([[info.rank], [10 + info.rank]]), g, dim=1)
    assert got.tolist() == [list(range(g.size)), [10 + i for i in range(g.size)]]


def orders_bound(x: torch.Tensor, size: int) -> dict:
    """assert_close's bounds between two sums over ``size`` ranks of tensors like ``x`` made
    in different orders: two addends give one sum whatever the order; more round on their
    own, each of the size - 1 additions by up to an ulp of a partial sum (below size * |x|)."""
    if size == 2:
        return dict(rtol=0, atol=0)
    return dict(rtol=0, atol=(size - 1) * torch.finfo(x.dtype).eps * size * x.abs().max().item())


def test_small_sums_take_the_symmetric_memory_kernel_on_gpus_also_inside_a_graph(info):
    """On GPUs (NCCL) the TP group's small all-reduces run torch's one-shot symmetric-memory
    kernel: the same sums as NCCL's, in place, bf16 and float32, replayed from a CUDA graph
    too; larger tensors and CPU ranks (gloo) take the process group's all-reduce."""
    g = ParallelGroups.build(Layout(tp=info.world_size, dp=1), info.rank, info.world_size).tp
    nccl = ParallelGroups.build(Layout(tp=info.world_size, dp=1, all_reduce="nccl"), info.rank, info.world_size).tp
    assert nccl.fast_sum is None and (g.fast_sum is not None) == (info.device.type == "cuda")
    gen = torch.Generator().manual_seed(info.rank)
    for dtype, shape in ((torch.bfloat16, (3, 64)), (torch.float32, (64, 1024)), (torch.bfloat16, (2048, 1024))):
        x = torch.randn(shape, generator=gen, device="cpu").to(info.device, dtype)
        want = all_reduce(x.clone(), nccl)
        got = x.clone()
        assert all_reduce(got, g) is got
        torch.testing.assert_close(got, want, **orders_bound(x, g.size))
        if g.fast_sum is not None:
            assert g.fast_sum.takes(x) == (x.nbytes <= g.fast_sum.MAX_BYTES)
    if g.fast_sum is not None:
        x = torch.randn(8, 256, generator=gen, device="cpu").to(info.device, torch.bfloat16)
        buf = x.clone()
        all_reduce(buf, g)  # outside the capture: its buffer is made (a collective)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_reduce(buf, g)
        buf.copy_(x)
        graph.replay()
        torch.testing.assert_close(buf, all_reduce(x.clone(), nccl), **orders_bound(x, g.size))


def test_uneven_all_to_all_delivers_every_row(info):
    g = ParallelGroups.build(Layout(tp=info.world_size, dp=1), info.rank, info.world_size).tp
    me = g.rank
    counts = torch.tensor([me + dst + 1 for dst in range(g.size)])  # uneven, never zero
    rows = torch.cat([torch.tensor([[me, dst, i] for i in range(me + dst + 1)]) for dst in range(g.size)])
    out, recv = all_to_all(rows, counts, g)
    assert recv == [src + me + 1 for src in range(g.size)]
    expected = [[src, me, i] for src in range(g.size) for i in range(src + me + 1)]
    assert out.tolist() == expected
    back, sent = all_to_all(out, recv, g, recv_counts=counts)  # the return trip: counts known
    assert sent == counts.tolist() and back.equal(rows)


def test_column_then_row_parallel_equals_the_full_mlp(info):
    """A tensor-parallel MLP (column-parallel up, row-parallel down, one all-reduce) equals
    the unsplit MLP; every rank builds the full one from the same seed."""
    g = ParallelGroups.build(Layout(tp=info.world_size, dp=1), info.rank, info.world_size).tp
    torch.manual_seed(0)
    up, down = nn.Linear(12, 8 * g.size), nn.Linear(8 * g.size, 12)
    x = torch.randn(5, 12)
    ref = down(torch.nn.functional.gelu(up(x)))
    col = ColumnParallelLinear(12, 8 * g.size, True, g)
    row = RowParallelLinear(8 * g.size, 12, True, g)
    with torch.no_grad():
        col.weight.copy_(col.shard_fns["weight"](up.weight))
        col.bias.copy_(col.shard_fns["bias"](up.bias))
        row.weight.copy_(row.shard_fns["weight"](down.weight))
        row.bias.copy_(down.bias)  # kept whole
        out = row(torch.nn.functional.gelu(col(x)))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_single_rank_group_is_a_no_op(info):
    alone = Group.alone(info.rank)
    x = torch.randn(4, 3)
    assert all_reduce(x.clone(), alone).equal(x) and all_gather(x, alone).equal(x)
    out, recv = all_to_all(x, torch.tensor([4]), alone)
    assert out.equal(x) and recv == [4]
