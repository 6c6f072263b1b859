"""Experts in host memory (engine.gpu_memory_gb): the planner's choices, and the same results
as the unbounded model for every way cold experts run. On CPU the "device" is host memory
too; what is checked is the placement and the math of each path."""
import json
import math

import pytest
import torch

import moe_infer
from moe_infer import offload as off
from moe_infer.config import ConfigError
from moe_infer.experts import Experts
from moe_infer.layer_streamer import LayerStreamer

PROMPTS = [[5, 17, 3, 44, 12, 9, 31], [8, 2], [60, 1, 19, 27, 4]]


@pytest.fixture(scope="module")
def full():
    return moe_infer.load("tiny-moe", progress=False, device="cpu")


def budgets(engine) -> tuple[float, int]:
    """-> (GB of the weights that are not routed experts, bytes of one expert)."""
    p = off.plan(engine.model, 1e12)
    return (p.device_bytes - sum(map(len, p.hot)) * p.expert_bytes) / 1e9, p.expert_bytes


def test_the_plan_keeps_the_most_routed_experts_and_spreads_even_counts(full):
    fixed, one = budgets(full)
    layers = len(off.expert_layers(full.model))
    spread = off.plan(full.model, fixed * 1e9 + 2 * layers * one)
    assert spread.hot == [[0, 1]] * layers  # no counts: the same number in every layer
    counts = [[0, 9, 0, 0, 0, 7], [5, 0, 0, 0, 0, 0], [0] * 6, [0, 0, 0, 1, 0, 0]]
    picked = off.plan(full.model, fixed * 1e9 + 3.5 * one, counts)
    assert picked.hot == [[1, 5], [0], [], []]  # the three most routed, whatever their layer
    assert picked.device_bytes == pytest.approx(fixed * 1e9 + 3 * one)
    with pytest.raises(ConfigError, match=r"engine\.gpu_memory_gb=0\.001: the weights that are not routed "
                                          r"experts .* need [0-9.]+ GB on the device; expected at least that"):
        off.plan(full.model, 0.001e9)


@pytest.mark.parametrize("pairs, experts, want", [(2, 2, "cpu"), (4096, 60, "stream")])
def test_cold_experts_run_where_the_machine_says_they_are_faster(pairs, experts, want):
    """A host with a slow copy link and a CPU that reads weights fast but multiplies
    slowly: few tokens on the CPU, many streamed."""
    profile = off.MachineProfile(h2d_bytes_s=25e9, cpu_bytes_s=100e9, cpu_flops=1e12)
    cost = off.ColdCost(profile, expert_bytes=352 << 20, expert_flops=2 * 176 << 20)
    assert cost.mode(pairs, experts) == want
    fast_link = off.MachineProfile(h2d_bytes_s=400e9, cpu_bytes_s=100e9, cpu_flops=1e12)
    assert off.ColdCost(fast_link, 352 << 20, 2 * 176 << 20).mode(2, 2) == "stream"


def test_auto_follows_what_each_way_has_cost_here():
    """The profile favours the CPU, but CPU calls took ten times their prediction and
    streamed ones what was predicted: auto streams, and tries the CPU again once the
    streaming since its last try has cost RETRY CPU calls (where it would come back if the
    CPU got faster), so the slower the CPU, the rarer its tries."""
    profile = off.MachineProfile(h2d_bytes_s=25e9, cpu_bytes_s=50e9, cpu_flops=1e12)
    cost = off.ColdCost(profile, expert_bytes=1 << 20, expert_flops=2 << 20)
    assert cost.mode(2, 2) == "cpu"
    cpu, stream = cost.predict("cpu", 2, 2), cost.predict("stream", 2, 2)
    # each way's first call pays one-time costs (compiles, first touch): passed over
    cost.observe("cpu", cpu, 1000 * cpu)
    cost.observe("stream", stream, 1000 * stream)
    for _ in range(10):
        cost.observe("cpu", cpu, 10 * cpu)
        cost.observe("stream", stream, stream)
    assert (cost.scale("cpu"), cost.scale("stream")) == (10, 1)
    ratio = cost.scale("cpu") * cpu / (cost.scale("stream") * stream)
    every = math.ceil(cost.RETRY * ratio)  # streamed calls between CPU tries
    ways = [cost.mode(2, 2) for _ in range(2 * every + 2)]
    tries = [i for i, w in enumerate(ways) if w == "cpu"]
    assert ways[0] == "stream" and len(tries) == 2 and tries[1] - tries[0] == every + 1
    for _ in range(cost.WINDOW):
        cost.observe("cpu", cpu, 0.5 * cpu)
    assert cost.mode(2, 2) == "cpu"


def test_one_time_costs_in_a_ways_first_calls_do_not_keep_auto_off_it():
    """Streaming is the faster way, but its first calls each compiled a kernel for a new
    shape (hundreds of times a call): auto takes the CPU meanwhile, yet tries streaming
    again as often as the profile's figure allows, and streams from the first try that
    shows what streaming costs."""
    profile = off.MachineProfile(h2d_bytes_s=50e9, cpu_bytes_s=50e9, cpu_flops=1e12)
    cost = off.ColdCost(profile, expert_bytes=1 << 20, expert_flops=2 << 20)
    cpu, stream = cost.predict("cpu", 8, 8), cost.predict("stream", 8, 8)
    for _ in range(cost.WINDOW):
        cost.observe("cpu", cpu, 2 * cpu)
    for _ in range(3):
        cost.observe("stream", stream, 500 * stream)
    ways = [cost.mode(8, 8) for _ in range(2 * cost.RETRY)]
    assert ways[0] == "cpu" and 0 < ways.index("stream") <= math.ceil(cost.RETRY * stream / (2 * cpu))
    cost.observe("stream", stream, 1.5 * stream)
    assert cost.mode(8, 8) == "stream"


@pytest.mark.parametrize("mode", ["cpu", "stream", "auto"])
@pytest.mark.parametrize("hot", [0, 3])
def test_an_offloaded_model_gives_the_unbounded_tokens(full, mode, hot):
    fixed, one = budgets(full)
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu",
                            gpu_memory_gb=fixed + hot * one / 1e9, offload=mode)
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    assert sum(len(m.hot) for m in layers) == hot and all(m.num_cold == 6 - len(m.hot) for m in layers)
    assert engine.decode_mode == "eager"
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == \
        [o.token_ids for o in full.generate(PROMPTS, max_new_tokens=8)]
    torch.testing.assert_close(engine.logits(PROMPTS), full.logits(PROMPTS), rtol=1e-5, atol=1e-5)
    area = layers[0].area  # one staging area for every layer, of AREAS rounds
    assert all(m.area is area for m in layers)
    if mode == "stream":
        assert area.turn >= len(layers) and all(t.shape[0] == off.AREAS * area.round_size
                                                for t in area.tensors.values())
    if mode == "auto":  # the calls' times reached the choice
        assert any(layers[0].cost.ratios.values())


@pytest.mark.parametrize("quantize,mode", [("int8", "cpu"), ("mxfp4", "cpu"), ("mxfp4", "stream")])
def test_quantized_experts_offload_too(quantize, mode):
    q = moe_infer.load("tiny-moe", progress=False, device="cpu", quantize=quantize)
    fixed, one = budgets(q)
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu", quantize=quantize,
                            gpu_memory_gb=fixed + one / 1e9, offload=mode)
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == \
        [o.token_ids for o in q.generate(PROMPTS, max_new_tokens=8)]


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_cold_experts_in_several_staging_rounds_and_mixed_pairs(mode):
    """One layer, its experts split 2 on the device / 5 cold, a staging area of one expert a
    round: every pair's output (hot, cold, several rounds) as the whole layer's; and two
    layers sharing one area."""
    gen = torch.Generator().manual_seed(0)
    experts = Experts(7, 24, 40, "swiglu")
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.2)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.2)
    profile = off.MachineProfile(1e9, 1e9, 1e9)
    layer = off.OffloadedExperts(experts, [2, 5], torch.device("cpu"), mode, off.ColdCost(profile, 1, 1), staging=1)
    x = torch.randn(9, 24, generator=gen)
    ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(9)])
    w = torch.rand(9, 3, generator=gen)
    torch.testing.assert_close(layer.fused(x, ids, w), experts.fused(x, ids, w), rtol=1e-5, atol=1e-6)
    hot_only = torch.tensor([[2, 5, 2]] * 9)
    torch.testing.assert_close(layer.fused(x, hot_only, w), experts.fused(x, hot_only, w), rtol=1e-5, atol=1e-6)
    every = off.OffloadedExperts(experts, list(range(7)), torch.device("cpu"), mode, off.ColdCost(profile, 1, 1))
    every.set_hot([3])  # a layer placed whole, then cooled by a rebalance
    torch.testing.assert_close(every.fused(x, ids, w), experts.fused(x, ids, w), rtol=1e-5, atol=1e-6)
    # Two layers sharing one staging area (as a model's do), their calls in turn: each
    # call's rounds take the parts where the other's left off.
    other = random_experts(7, 24, 40, seed=1)
    area = off.Staging(7, staging=2)
    pair = [off.OffloadedExperts(e, hot, torch.device("cpu"), mode, off.ColdCost(profile, 1, 1), area=area)
            for e, hot in ((experts, [2, 5]), (other, [0]))]
    for _ in range(2):
        for layer, e in zip(pair, (experts, other)):
            torch.testing.assert_close(layer.fused(x, ids, w), e.fused(x, ids, w), rtol=1e-5, atol=1e-6)
    assert area.turn == (0 if mode == "cpu" else 2 * (5 + 6))  # a round an expert: 5 cold, then 6


def random_experts(e: int, h: int, f: int, seed: int = 0) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = Experts(e, h, f, "swiglu")
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) * 0.2)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) * 0.2)
    return experts


@pytest.mark.parametrize("mode", ["stream", "auto"])
def test_decode_sized_calls_read_cold_experts_in_place_and_count_what_they_met(mode, monkeypatch):
    """Calls of at most ``in_place`` tokens run every pair without a host wait (neither
    the CPU's experts nor the staging area); larger ones take them. Both give the whole
    layer's outputs, masked pairs (experts elsewhere) included, and the device tally counts
    the pairs here, the cold ones and the distinct cold experts of each call."""
    gen = torch.Generator().manual_seed(1)
    experts = random_experts(7, 24, 40)
    profile = off.MachineProfile(1e9, 1e9, 1e9)
    layer = off.OffloadedExperts(experts, [2, 5], torch.device("cpu"), mode, off.ColdCost(profile, 1, 1),
                                 staging=2, in_place=4)
    assert (layer.waits_for_host(4), layer.waits_for_host(5)) == (False, True)
    assert off.OffloadedExperts(experts, [2], torch.device("cpu"), "cpu", off.ColdCost(profile, 1, 1),
                                in_place=4).waits_for_host(1)  # mode cpu: never in place
    slow = {}
    for name in ("_on_cpu", "_stage_round"):
        real = getattr(off.OffloadedExperts, name)
        monkeypatch.setattr(off.OffloadedExperts, name, lambda self, *a, real=real, name=name:
                            slow.setdefault(name, 0) or real(self, *a))
    want = {"pairs": 0, "cold_pairs": 0, "cold_experts": 0}
    for t, masked in ((1, False), (4, True), (3, False), (9, False), (6, True)):
        x = torch.randn(t, 24, generator=gen)
        ids = torch.stack([torch.randperm(7, generator=gen)[:3] for _ in range(t)])
        if masked:  # a third of the pairs elsewhere
            ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.33, -1, ids)
        w = torch.rand(t, 3, generator=gen)
        slow.clear()
        torch.testing.assert_close(layer.fused(x, ids, w, masked=masked), experts.fused(x, ids, w, masked=masked),
                                   rtol=1e-5, atol=1e-6)
        assert bool(slow) == (t > 4)
        here = ids[ids >= 0]
        cold = here[(here != 2) & (here != 5)]
        want = {"pairs": want["pairs"] + len(here), "cold_pairs": want["cold_pairs"] + len(cold),
                "cold_experts": want["cold_experts"] + len(set(cold.tolist()))}
        assert {k: layer.stats[k] for k in want} == want
    stats = layer.stats
    assert stats["cpu"] + stats["stream"] == 5  # every call met a cold pair
    assert layer.routed.sum().item() == stats["pairs"]


def test_a_layer_with_no_device_experts_whose_pairs_are_all_elsewhere_adds_nothing(monkeypatch):
    """Under expert parallelism a rank's layer may keep none of its experts on the device
    and meet only pairs of other ranks (masked ids): zeros, no kernel over zero experts."""
    experts = Experts(4, 16, 24, "swiglu")
    layer = off.OffloadedExperts(experts, [], torch.device("cpu"), "cpu",
                                 off.ColdCost(off.MachineProfile(1e9, 1e9, 1e9), 1, 1))
    monkeypatch.setattr(off.kernels, "fused_moe", lambda *a, **k: pytest.fail("a kernel ran over zero experts"))
    x = torch.randn(5, 16)
    out = layer.fused(x, torch.full((5, 2), -1), torch.rand(5, 2), masked=True)
    assert out.shape == x.shape and not out.any()


def test_a_budget_below_the_dense_part_fails_at_load_with_one_line(full):
    fixed, _ = budgets(full)
    with pytest.raises(ConfigError, match=r"^engine\.gpu_memory_gb=[0-9.e-]+: the weights that are not routed experts"):
        moe_infer.load("tiny-moe", progress=False, device="cpu", gpu_memory_gb=fixed / 2)


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_the_fit_check_counts_the_staging_area_streamed_calls_take(monkeypatch, mode):
    """Mixtral at a 40 GB budget: its layers share one staging area of 8 experts (2.8 GB in
    bf16), which a device with room for the budget and the KV cache alone lacks; the CPU
    way takes none."""
    from moe_infer import memory
    from moe_infer.config_files import load_preset

    cfg = load_preset("mixtral-8x7b")
    cfg.engine.gpu_memory_gb, cfg.engine.offload = 40.0, mode
    model = memory.meta_model(cfg)
    staging = off.staging_bytes(model, torch.bfloat16)
    assert staging == 8 * 3 * 4096 * 14336 * 2
    kv = memory.memory_need(cfg, torch.bfloat16, int8=False).kv
    monkeypatch.setattr(memory, "available_bytes", lambda device: int(40e9) + kv + staging // 2)
    if mode == "cpu":
        memory.check_offload_fits(cfg, torch.bfloat16, torch.device("cuda"), model)
        return
    with pytest.raises(ConfigError, match=r"^engine\.gpu_memory_gb=40: with one sequence's KV cache \([\d.]+ GB\) "
                                          r"and the staging area for streamed experts \(2\.82 GB\) it needs"):
        memory.check_offload_fits(cfg, torch.bfloat16, torch.device("cuda"), model)


def test_rebalance_moves_each_layers_most_routed_experts_onto_the_device(full):
    """The routing counts decide which experts a layer keeps on the device, as many as its
    placement gave it (the kernels specialise on that count), an expert already there
    staying where counts tie; the incoming ones are copied into the device tensors in
    place, and the results do not change when experts move."""
    fixed, one = budgets(full)
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu",
                            gpu_memory_gb=fixed + 3 * one / 1e9, offload="cpu")
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    assert [m.hot for m in layers] == [[0], [0], [0], []]  # no counts at load: spread over the layers
    tensors = [m.w13 for m in layers]
    for m, counts in zip(layers, ([0, 0, 0, 0, 9, 8], [0, 0, 0, 0, 0, 1], [0] * 6, [0] * 6)):
        m.routed.copy_(torch.tensor(counts, dtype=torch.float32))
    assert off.rebalance(engine.model) == 2
    assert [m.hot for m in layers] == [[4], [5], [0], []]
    assert all(m.w13 is t for m, t in zip(layers, tensors))
    assert torch.equal(layers[0].w13[0], layers[0].host["w13"][4]) and layers[0].slot.tolist()[4] == 0
    assert [m.routed.tolist() for m in layers][0] == [0, 0, 0, 0, 4.5, 4.0]  # weighed down
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == \
        [o.token_ids for o in full.generate(PROMPTS, max_new_tokens=8)]
    assert [len(m.hot) for m in layers] == [1, 1, 1, 0]  # generate() placed them by its prompts' routing


def test_streamed_layers_give_the_unbounded_results(full):
    """offload: layers (ZeRO-Inference): every block's weights in host memory, copied in as
    it runs; the same tokens and logits."""
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu", offload="layers")
    assert engine.decode_mode == "eager"
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == \
        [o.token_ids for o in full.generate(PROMPTS, max_new_tokens=8)]
    torch.testing.assert_close(engine.logits(PROMPTS), full.logits(PROMPTS), rtol=0, atol=0)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_layer_streamer_holds_at_most_prefetch_plus_one_blocks(prefetch):
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu")
    want = engine.logits(PROMPTS)
    streamer = LayerStreamer(engine.model.layers, torch.device("cpu"), prefetch)
    held, enter = [], streamer._enter

    def counting(i):
        enter(i)
        held.append(len(streamer.ready))
        # the block runs on the copies, not on its host weights
        assert engine.model.layers[i].attn_norm.weight is not streamer.host[i][0][3]
    streamer._enter = counting
    torch.testing.assert_close(engine.logits(PROMPTS), want, rtol=0, atol=0)
    assert held and max(held) == min(prefetch + 1, len(engine.model.layers))
    assert all(b.attn_norm.weight is h[0][3] for b, h in zip(engine.model.layers, streamer.host))  # put back


def test_the_runner_re_places_offloaded_experts_every_few_steps(full, monkeypatch):
    import moe_infer.runner as runner_module

    fixed, one = budgets(full)
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu",
                            gpu_memory_gb=fixed + 2 * one / 1e9, offload="cpu")
    engine.REBALANCE_STEPS = 3
    calls = []
    monkeypatch.setattr(runner_module, "rebalance", lambda model: calls.append(model))
    engine.generate(PROMPTS, max_new_tokens=8)  # one prefill forward and 7 decode steps
    assert len(calls) == 8 // 3 and all(m is engine.model for m in calls)


@pytest.mark.parametrize("what", ["experts", "kv"])
def test_the_server_runs_an_offloaded_model(full, what):
    """Experts (or the KV cache) in host memory behind the OpenAI server: the tokens of the
    unbounded model."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_server import LiveServer

    from moe_infer.server import ServerConfig, create_app

    fixed, one = budgets(full)
    if what == "kv":
        engine = moe_infer.load("tiny-moe", progress=False, device="cpu", kv_offload="all")
    else:
        engine = moe_infer.load("tiny-moe", progress=False, device="cpu",
                                gpu_memory_gb=fixed + 2 * one / 1e9, offload="auto")
        engine.REBALANCE_STEPS = 4  # experts move while it serves
    live = LiveServer(create_app(engine, ServerConfig(model_name="tiny")))
    try:
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            got = [t for e in events for t in e["choices"][0].get("token_ids") or []]
            assert got == full.generate([prompt], max_new_tokens=6)[0].token_ids
    finally:
        live.stop()


@pytest.mark.parametrize("layers", [False, True], ids=["experts", "layers"])
def test_weights_in_host_memory_can_be_memory_mapped_from_files(full, tmp_path, layers):
    """engine.offload_dir: what stays in host memory is file-backed (written at load, read
    by the operating system as calls need it), with the same values and tokens."""
    fixed, one = budgets(full)
    kw = dict(offload="layers") if layers else dict(gpu_memory_gb=fixed + one / 1e9, offload="stream")
    engine = moe_infer.load("tiny-moe", progress=False, device="cpu", offload_dir=str(tmp_path), **kw)
    files = sorted(tmp_path.iterdir())
    assert files and all(f.stat().st_size > 0 for f in files)
    if layers:  # every block's weights, as the streamer puts them back between forwards
        mapped = [p for b in engine.model.layers for p in b.parameters()]
    else:
        mapped = [m.host[k] for m in engine.model.modules() if isinstance(m, off.OffloadedExperts) for k in m.host]
    assert mapped and all(t.untyped_storage().filename for t in mapped)
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=8)] == \
        [o.token_ids for o in full.generate(PROMPTS, max_new_tokens=8)]
    torch.testing.assert_close(engine.logits(PROMPTS), full.logits(PROMPTS), rtol=1e-5, atol=1e-5)


def rel_err(got, ref):
    return ((got.float().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cpu", "stream", "layers"])
def test_offloaded_bf16_on_a_gpu_is_as_close_to_float32_as_the_whole_model(full, mode):
    """The GPU paths (pinned host copies read in place, the copy streams of the staging area
    and of the layer streamer, the CPU experts beside the GPU's): bf16 logits no further
    from the float32 model than twice the unbounded bf16 model's error; experts read in
    place decode in CUDA graphs."""
    ref = full.logits(PROMPTS)
    whole = moe_infer.load("tiny-moe", progress=False, device="cuda", dtype="bfloat16")
    bound = 2 * rel_err(whole.logits(PROMPTS), ref)
    fixed, one = budgets(full)
    # the float32 sizes: in bf16 about 10 of the 24 experts fit, the rest stay in host memory
    kw = dict(offload="layers") if mode == "layers" else dict(gpu_memory_gb=fixed + one / 1e9, offload=mode)
    engine = moe_infer.load("tiny-moe", progress=False, device="cuda", dtype="bfloat16", **kw)
    assert engine.decode_mode == ("graph" if mode == "stream" else "eager")
    assert rel_err(engine.logits(PROMPTS), ref) <= bound
    out = engine.generate(PROMPTS, max_new_tokens=8)
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in out)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_cold_experts_read_in_place_on_a_gpu_decode_in_graphs_as_eagerly(full, quantize, monkeypatch):
    """The kernels read the cold experts from pinned host memory (at decode sizes: the CUDA
    decode kernels or the Triton GEMMs, as the tables choose): in float32 (no bf16 ties)
    the logits of the whole model, and graph decode gives eager decode's tokens, batch 1
    and 8, as the experts move between the device and the host. In bf16 under "auto" the
    prompts' way is fixed to the staging area: auto follows the measured times, and the
    CPU's bf16 rounding would make a run's tokens follow them."""
    kw = dict(device="cuda", progress=False, quantize=quantize)
    whole = moe_infer.load("tiny-moe", dtype=torch.float32, **kw)
    fixed, one = budgets(whole)
    engine = moe_infer.load("tiny-moe", dtype=torch.float32, gpu_memory_gb=fixed + 4 * one / 1e9, offload="stream",
                            **kw)
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    assert engine.decode_mode == "graph" and all(m.host["w13"].is_pinned() for m in layers)
    torch.testing.assert_close(engine.logits(PROMPTS), whole.logits(PROMPTS), rtol=1e-4, atol=1e-4)
    for prompts in (PROMPTS[:1], PROMPTS * 3):
        graphs = [o.token_ids for o in engine.generate(prompts, max_new_tokens=12)]
        engine.decode_mode = "eager"
        assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=12)] == graphs
        engine.decode_mode = "graph"
    assert sum(m.stats["cold_pairs"] for m in layers) > 0

    fixed, one = budgets(moe_infer.load("tiny-moe", dtype="bfloat16", **kw))
    monkeypatch.setattr(off.ColdCost, "mode", lambda self, cold_pairs, cold_experts: "stream")
    bf16 = moe_infer.load("tiny-moe", dtype="bfloat16", gpu_memory_gb=fixed + 4 * one / 1e9, offload="auto", **kw)
    graphs = [o.token_ids for o in bf16.generate(PROMPTS * 3, max_new_tokens=12)]
    assert bf16.decode_mode == "graph"
    bf16.decode_mode = "eager"
    assert [o.token_ids for o in bf16.generate(PROMPTS * 3, max_new_tokens=12)] == graphs


@pytest.mark.parametrize("source,mode", [("tiny-moe", "all"), ("tiny-moe", "alternate"), ("deepseek_v3", "all"),
                                         ("gpt_oss", "alternate")])
def test_an_offloaded_kv_cache_gives_the_tokens_and_the_pools_of_the_device_cache(source, mode, tmp_path):
    """engine.kv_offload: the keys and values in host memory, two layers' pools on the
    "device" (with "alternate", the even layers' on this device 0 offloaded, the odd ones
    kept) -- the same tokens as the cache on the device (prompts prefilled in pieces,
    decode steps, latent attention's one-pool cache, sliding layers and sinks), and the
    same keys in the host pools afterwards."""
    if source != "tiny-moe":
        from hf_models import save_hf_model

        save_hf_model(source, tmp_path)
        source = tmp_path
    kw = dict(device="cpu", dtype=torch.float32, progress=False)
    plain, offloaded = moe_infer.load(source, **kw), moe_infer.load(source, **kw, kv_offload=mode)
    prompts = PROMPTS + [[(7 * i) % 50 + 1 for i in range(23)]]
    for engine in (plain, offloaded):
        engine.config.engine.prefill_tokens = 24  # the long prompt in pieces beside the others
    want = [o.token_ids for o in plain.generate(prompts, max_new_tokens=6)]
    assert [o.token_ids for o in offloaded.generate(prompts, max_new_tokens=6)] == want
    cache, ref = offloaded.runner.cache, plain.runner.cache
    layers = ref.k.shape[0]
    off = list(range(layers)) if mode == "all" else list(range(0, layers, 2))
    assert cache.offloaded == off and cache.k.shape[0] == min(2, len(off)) and cache.host_k.shape[0] == len(off)
    assert cache.kept_k.shape[0] == layers - len(off)
    torch.testing.assert_close(cache.host_k[:, :-1], ref.k[off, :-1])  # (the last slot takes padding)
    torch.testing.assert_close(cache.host_v[:, :-1], ref.v[off, :-1])
    kept = [i for i in range(layers) if i not in off]
    torch.testing.assert_close(cache.kept_k[:, :-1], ref.k[kept, :-1])


def test_an_offloaded_kv_cache_is_read_in_layer_order():
    from dense.kv_offload import OffloadedKVCache

    cache = OffloadedKVCache(3, 2, 4, 1, 8, torch.float32, "cpu")
    slots = torch.tensor([[0]])
    cache.use_slots(slots, slots)
    cache.pools(0), cache.pools(1), cache.pools(1)  # (a layer may ask twice: latent attention)
    with pytest.raises(RuntimeError, match="layer 0 after layer 1"):
        cache.pools(0)
    with pytest.raises(IndexError, match="layers 0 .. 2"):
        cache.pools(3)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["all", "alternate"])
def test_an_offloaded_kv_cache_on_a_gpu_gives_the_device_caches_tokens(mode):
    """The copy stream, the two device buffers taking the layers in turn and the pinned
    write-back: in float32 (no bf16 ties), the tokens and keys of the cache on the device."""
    kw = dict(device="cuda", dtype=torch.float32, progress=False)
    plain, offloaded = moe_infer.load("tiny-moe", **kw), moe_infer.load("tiny-moe", **kw, kv_offload=mode)
    plain.decode_mode = "eager"  # the same forwards on both
    prompts = PROMPTS * 3
    want = [o.token_ids for o in plain.generate(prompts, max_new_tokens=12)]
    assert [o.token_ids for o in offloaded.generate(prompts, max_new_tokens=12)] == want
    cache, ref = offloaded.runner.cache, plain.runner.cache
    assert cache.host_k.is_pinned() and cache.k.is_cuda and cache.k.shape[0] == min(2, len(cache.offloaded))
    torch.testing.assert_close(cache.host_k[:, :-1], ref.k[cache.offloaded, :-1].cpu(), rtol=1e-5, atol=1e-6)
