"""Tensor, expert and expert-sliced parallel models equal the single-process model.
Run under mpirun with 2 and 4 ranks: CI on CPU with gloo (scripts/test.sh), and on GPUs
with NCCL (scripts/launch.sh -n 4 -- python -m pytest -m mpi tests/test_model_mpi.py).

Rank 0 writes a tiny Hugging Face checkpoint; every rank loads it once alone (the
reference) and once with the layout. float32 logits must agree to 1e-5 relative on CPU
(1e-4 on GPUs, where cuBLAS picks different kernels for the split shapes) with identical
greedy tokens. On GPUs each layout also runs in bf16: its error against the float32
single-process logits may be at most three times the single-process bf16 model's own error
(times the root of tp / 2 beyond two TP ranks); in float32 its captured decode steps
(collectives inside the graphs) give the eager decode's tokens.
"""
import math
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import moe_infer
from comm import Group, all_gather_json
from dense.parallel_linear import VocabParallelHead
from hf_models import save_hf_model
from moe_infer import ParallelConfig
from moe_infer.moe_layer import MoELayer
from parity import rel_err
from moe_infer.outputs import Sampled

pytestmark = pytest.mark.mpi
PROMPTS = [[5, 17, 3, 44, 12, 9, 31], [8, 2], [60, 1, 19, 27, 4]]
# Families with heads, KV heads and experts that 2 and 4 ranks divide (OLMoE: q/k norms
# over all heads, so across ranks, at head dim 16, which the one-launch decode attention
# takes on a GPU; Qwen2-MoE: q/k/v biases and a gated shared expert).
FAMILY_KW = {
    "qwen2_moe": dict(num_attention_heads=8, num_key_value_heads=2, num_experts=8, hidden_size=64,
                      moe_intermediate_size=24, shared_expert_intermediate_size=32, intermediate_size=48,
                      num_hidden_layers=4),
    "olmoe": dict(num_attention_heads=8, num_key_value_heads=4, num_experts=8, hidden_size=128,
                  intermediate_size=24, num_hidden_layers=4),
    # sinks split with the heads, biased experts split by rank (and by width under slicing)
    "gpt_oss": dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, hidden_size=64,
                    head_dim=8, intermediate_size=24, num_hidden_layers=4,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    # latent attention: heads split, the latent and its cache whole on every rank
    "deepseek_v3": dict(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, n_group=2, topk_group=1,
                        hidden_size=64, moe_intermediate_size=24, intermediate_size=48, num_hidden_layers=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    # weights on the experts' inputs (scaled before the all-to-all under ep), chunks, NoPE
    "llama4_text": dict(num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, hidden_size=64,
                        head_dim=8, intermediate_size=24, intermediate_size_mlp=32, num_hidden_layers=4),
}


def layouts(world):
    """(name, ParallelConfig) for this world size; the dense part fills the world with dp."""
    out = [("tp", dict(tp=world)), ("tp-replicated-experts", dict(tp=world, expert_slicing=1)),
           ("tp-nccl", dict(tp=world, all_reduce="nccl")), ("ep", dict(dp=world, ep=world)),
           ("ep-fixed-a2a", dict(dp=world, ep=world, a2a_fixed_tokens=64)),
           ("ep-dp-attention", dict(dp=world, ep=world, dp_attention=True)),
           (f"pp{world}", dict(pp=world)), ("tp-kv-tokens", dict(tp=world, kv_shard="tokens"))]
    if world == 4:
        out += [("tp2-ep2-pcc", dict(tp=2, dp=2, ep=2, pcc=True)), ("tp2-ep2-naive", dict(tp=2, dp=2, ep=2, pcc=False)),
                ("tp2-ep4-pcc", dict(tp=2, dp=2, ep=4, pcc=True)),
                ("tp2-ep4-pcc-fixed-a2a", dict(tp=2, dp=2, ep=4, pcc=True, a2a_fixed_tokens=64)),
                ("tp2-ep4-pcc-dp-attention", dict(tp=2, dp=2, ep=4, pcc=True, dp_attention=True)),
                ("pp2-tp2", dict(pp=2, tp=2)), ("pp2-ep2", dict(pp=2, dp=2, ep=2)),
                ("ep2-slicing2", dict(dp=4, ep=2, expert_slicing=2)),
                ("tp2-ep2-slicing2-pcc", dict(tp=2, dp=2, ep=2, expert_slicing=2, pcc=True)),
                ("tp2-slicing2-pcc", dict(tp=2, dp=2, ep=1, expert_slicing=2, pcc=True)),
                ("tp2-ep2-kv-tokens", dict(tp=2, dp=2, ep=2, kv_shard="tokens"))]
    else:
        out += [("slicing2", dict(dp=2, ep=1, expert_slicing=2))]
    return out


@pytest.fixture(scope="module", params=list(FAMILY_KW))
def checkpoint(request, info):
    import hf_models

    spec = hf_models.FAMILIES[request.param]
    saved = dict(spec["kw"])
    spec["kw"].update(FAMILY_KW[request.param])
    # Rank 0 writes (transformers saves on the main process only); the ranks share /tmp.
    # torch.distributed's gloo waits without spinning, unlike an MPI barrier, which on a
    # 2-core machine starves rank 0 while the others poll.
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    try:
        if dist.get_rank() == 0:
            save_hf_model(request.param, box[0])
        dist.broadcast_object_list(box, src=0)
        path = box[0]
    finally:
        spec["kw"].clear()
        spec["kw"].update(saved)
    reference = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False)
    return path, reference


def test_layouts_match_single_process(info, checkpoint):
    path, reference = checkpoint
    ref = reference.logits(PROMPTS)
    ref_tokens = [o.token_ids for o in reference.generate(PROMPTS, max_new_tokens=5)]
    on_gpu = info.device.type == "cuda"
    if on_gpu:
        bf16_alone = moe_infer.load(path, device=info.device, dtype=torch.bfloat16, progress=False)
        bf16_error = rel_err(bf16_alone.logits(PROMPTS), ref)
        del bf16_alone
    for name, kw in layouts(info.world_size):
        engine = moe_infer.load(path, device=info.device, dtype=torch.float32, parallel=ParallelConfig(**kw),
                                progress=False)
        err = rel_err(engine.logits(PROMPTS), ref)
        assert err < (1e-4 if on_gpu else 1e-5), f"{name}: relative error {err:.2e}"
        moe = [m for m in engine.model.modules() if isinstance(m, MoELayer)]
        if name == "tp" and moe[0].shared is not None:  # the shared expert's sum joins the routed experts'
            assert all(m.fused_sum for m in moe), name
        expert_ranks = kw.get("ep", 1) * kw.get("expert_slicing", 1)
        if moe and moe[0].shared is not None and kw.get("tp", 1) == 1 and expert_ranks > 1:
            # the whole shared MLP runs beside the routed experts' collectives (a second stream on GPUs)
            assert all(m.overlap and not m.fused_sum for m in moe), name
        head = engine.model.lm_head
        if head is not None:  # split by vocabulary over the TP ranks, whole without TP
            assert isinstance(head, VocabParallelHead) == (kw.get("tp", 1) > 1), name
        assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == ref_tokens, name
        if not on_gpu:  # the fixed-shape prefill and decode steps (a graph's math, run eagerly), collectives inside
            engine.decode_mode = "static"
            assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == ref_tokens, name
            # (replicas in lockstep prefill eagerly: their token counts differ; pipeline
            # stages run their own blocks' steps, the prompts eagerly)
            assert (engine.runner._stage_steps if kw.get("pp", 1) > 1 else
                    engine.runner._steps and (engine.runner._prefills or engine.lockstep)), name
        if on_gpu:
            # Captured against eager decode in float32: in bfloat16 a near-tie may pick another
            # token where the two add in different orders (NCCL picks its all-reduce algorithm
            # per call; a pipeline stage's eager step sizes its attention's key splits by the
            # keys it holds, a captured one by the graph's).
            check_captured_decode(engine, kw, name)
        if on_gpu:
            del engine
            engine = moe_infer.load(path, device=info.device, dtype=torch.bfloat16,
                                    parallel=ParallelConfig(**kw), progress=False)
            err = rel_err(engine.logits(PROMPTS), ref)
            # One process's bfloat16 error is one draw of its roundings; a layout that adds in
            # another order is another draw, seen up to 2.3x the first (expert parallelism, 4
            # ranks). Each TP rank's partial sums are rounded to bfloat16 before they are added,
            # so the error grows with the ranks too (as the root of their number).
            bound = 3 * math.sqrt(max(1.0, kw.get("tp", 1) / 2)) * bf16_error
            assert err <= bound, f"{name} bf16: relative error {err:.2e} > {bound:.2e}"


def check_captured_decode(engine, kw, name):
    """Captured decode (the collectives inside the graphs) against eager decode."""
    graph = [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=12)]
    steps = engine.runner._stage_steps if kw.get("pp", 1) > 1 else engine.runner._steps
    assert engine.decode_mode == "graph" and any(s.graphs for s in steps.values()), name
    engine.decode_mode = "eager"
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=12)] == graph, name
    engine.decode_mode = "graph"


def test_pipeline_schedule_with_rows_that_end_at_different_steps(info, checkpoint):
    """The micro-batched schedule (drained every token, re-queued, more groups than
    stages; prompts in more groups than rows; fewer cache slots than rows, the waiting
    ones joining as rows end) gives the single process's greedy tokens and finish reasons
    where one row meets an EOS early, sampled tokens too (seeded)."""
    path, reference = checkpoint
    prompts = PROMPTS + [[7, 7, 7, 7, 7, 7, 7, 7, 7, 3], [11]]
    eos = reference.generate(prompts, max_new_tokens=8)[0].token_ids[2]  # the first row stops at its third
    saved, reference.eos = reference.eos, {eos}  # (the module's reference: restored below)
    try:
        want = [(o.token_ids, o.finish_reason) for o in reference.generate(prompts, max_new_tokens=8)]
        sampled = [o.token_ids for o in reference.generate(prompts, max_new_tokens=6, temperature=0.8, seed=3)]
    finally:
        reference.eos = saved
    assert want[0][1] == "stop" and {r for _, r in want} == {"stop", "length"}
    world = info.world_size
    # (the last: two rows hold the cache at a time, the others wait and join as rows end)
    for micro, prompt_micro, rows in ((1, 1, 16), (world, 8, 16), (world + 1, 2, 16), (world, 2, 2)):
        engine = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False,
                                parallel=ParallelConfig(pp=world, micro_batches=micro,
                                                        prompt_micro_batches=prompt_micro))
        engine.config.engine.max_batch_size = rows
        engine.eos = {eos}
        got = [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, max_new_tokens=8)]
        assert got == want, (micro, prompt_micro, rows)
        tl, stats = engine.last_timeline, engine.last_stats
        assert tl.stages == world and tl.slots > 8 and 0 <= tl.bubble < 1
        # The host time up to the last draw, split: prompts in the pipeline, decode alone.
        # A row's first token is no decode token; with every row in the cache at once the
        # pipeline ends holding decode steps alone.
        assert tl.prefill_s > 0 and tl.prefill_s + tl.decode_s <= tl.wall
        assert stats.decoded_tokens == tl.decoded <= sum(max(0, len(g) - 1) for g, _ in got)
        assert stats.decode_s == tl.decode_s
        if rows >= len(prompts):
            assert tl.decoded > 0
        got = [o.token_ids for o in engine.generate(prompts, max_new_tokens=6, temperature=0.8, seed=3)]
        assert got == sampled, (micro, prompt_micro, rows)
    # A unit's draws reach the host while the next slot runs: the decode rows feed their
    # tokens from the device, and each unit's draws are read after this stage has queued
    # more work (stage calls counted when a unit leaves and when its draws are read).
    calls, left, read = [], [], []
    stage, start, values = engine.runner.stage, Sampled.start, Sampled.values
    with mock.patch.object(engine.runner, "stage", lambda rows, h: calls.append(rows) or stage(rows, h)), \
            mock.patch.object(Sampled, "start", lambda *a: left.append(len(calls)) or start(*a)), \
            mock.patch.object(Sampled, "values", lambda s: read.append(len(calls)) or values(s)):
        assert [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, max_new_tokens=8)] == want
    decode_rows = [r for rows in calls for r in rows if r.tokens == [0] and r.start > 0]
    assert decode_rows and all(r.src >= 0 for r in decode_rows)
    assert len(left) == len(read) and all(r >= u for u, r in zip(left, read)) and any(r > u for u, r in zip(left, read))


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_dp_attention_replicas_step_together_whatever_their_shares(info, checkpoint, mode):
    """Replicas that split the prompts but share the experts (dp_attention) run every
    forward together: shares of different sizes (one replica without a prompt: it runs a
    stand-in), different numbers of prefill forwards (a small prefill budget), several
    batches, rows that stop early; the tokens are the single process's."""
    path, reference = checkpoint
    world = info.world_size
    layout = dict(dp=world, ep=world, dp_attention=True) if world == 2 else dict(tp=2, dp=2, ep=4, dp_attention=True)
    engine = moe_infer.load(path, device=info.device, dtype=torch.float32, parallel=ParallelConfig(**layout),
                            progress=False)
    assert engine.split_prompts and engine.lockstep
    if info.device.type == "cpu":
        engine.decode_mode = mode  # GPUs: the captured steps
    engine.config.engine.max_batch_size = 2
    prompts = PROMPTS * 3 + [[9] * 11, [4] * 62]  # the last one alone crosses a key bucket (64) while decoding
    for batch, budget in ((prompts[:1], 16384), (PROMPTS, 8), (prompts, 8)):
        engine.config.engine.prefill_tokens = budget
        want = [o.token_ids for o in reference.generate(batch, max_new_tokens=4)]
        assert [o.token_ids for o in engine.generate(batch, max_new_tokens=4)] == want, (len(batch), budget)
        # Every replica made the same fixed-shape steps (on GPUs a capture runs the step's
        # collectives: replicas capturing different ones would stall each other).
        made = all_gather_json(sorted(engine.runner._steps), Group(None, dist.get_rank(), world, tuple(range(world))),
                               info.device)
        assert all(m == made[0] for m in made), made
    stop = reference.generate(PROMPTS, max_new_tokens=3)[1].token_ids[1]  # row 1 ends after two tokens
    saved = reference.eos
    engine.eos = reference.eos = {stop}
    try:
        want = [o.token_ids for o in reference.generate(PROMPTS, max_new_tokens=6)]
        assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=6)] == want
    finally:
        reference.eos = saved  # the module's reference engine


def test_offloaded_experts_under_expert_parallelism(info, checkpoint):
    """Each rank places its own experts (one on the device, the rest in host memory, run by
    the CPU): the single process's tokens."""
    from moe_infer import offload as off

    path, reference = checkpoint
    layout = ParallelConfig(dp=info.world_size, ep=info.world_size)
    whole = moe_infer.load(path, device=info.device, dtype=torch.float32, parallel=layout, progress=False)
    p = off.plan(whole.model, 1e12)
    budget = (p.device_bytes - (sum(map(len, p.hot)) - 1) * p.expert_bytes) / 1e9  # one expert on the device
    del whole
    engine = moe_infer.load(path, device=info.device, dtype=torch.float32, parallel=layout, progress=False,
                            gpu_memory_gb=budget, offload="cpu")
    layers = [m for m in engine.model.modules() if isinstance(m, off.OffloadedExperts)]
    assert sum(len(m.hot) for m in layers) == 1 and all(m.num_cold for m in layers[1:])
    want = [o.token_ids for o in reference.generate(PROMPTS, max_new_tokens=5)]
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == want


def test_replicas_share_each_streamed_blocks_copy(info, checkpoint, monkeypatch):
    """offload: layers on replicas that hold the same weights: each rank copies a part of
    every block from host memory and an all-gather joins the parts; the replicas step
    together (shares of different sizes, one without prompts) and give the single
    process's tokens."""
    from moe_infer.layer_streamer import LayerStreamer

    path, reference = checkpoint
    gathered = []
    gather = LayerStreamer._gather
    monkeypatch.setattr(LayerStreamer, "_gather", lambda self, flat, lo, hi: (gathered.append(hi - lo),
                                                                              gather(self, flat, lo, hi)))
    engine = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False, offload="layers",
                            parallel=ParallelConfig(dp=info.world_size))
    assert engine.lockstep
    for prompts in (PROMPTS, PROMPTS[:1]):
        want = [o.token_ids for o in reference.generate(prompts, max_new_tokens=5)]
        assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=5)] == want
    assert gathered and all(n > 0 for n in gathered)


@pytest.mark.parametrize("checkpoint", ["olmoe"], indirect=True)  # (the family whose q / k norm spans all heads)
def test_all_heads_norm_over_split_heads_reads_the_other_ranks_heads_at_decode(info, checkpoint, monkeypatch):
    """OLMoE's q / k norm over all heads with the heads split over the TP ranks: a decode
    step projects the other ranks' q and k rows too and its one-launch attention adds their
    squares (no all-reduce of the sums); prompts project this rank's rows and all-reduce
    the sums. Both give the single process's tokens, in float32 and with int8 weights (whose
    row scales are sliced with the rows). (Head dim 16: the least the one-launch kernel
    takes on a GPU.)"""
    import kernels
    from dense.attention import Attention

    path, reference = checkpoint
    m = reference.config.model
    assert m.qk_norm == "full"
    calls, prenorms = [], []
    real, prenorm = kernels.qkv_attention, Attention._prenorm
    monkeypatch.setattr(kernels, "qkv_attention", lambda *a, **k: (calls.append(k["other_heads"]), real(*a, **k))[1])
    monkeypatch.setattr(Attention, "_prenorm", lambda self, qkv: (prenorms.append(qkv.shape[1]), prenorm(self, qkv))[1])
    tp = info.world_size
    for quantize in (None, "int8"):
        alone = reference if quantize is None else moe_infer.load(path, device=info.device, dtype=torch.float32,
                                                                  progress=False, quantize=quantize)
        want = [o.token_ids for o in alone.generate(PROMPTS, max_new_tokens=5)]
        engine = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False, quantize=quantize,
                                parallel=ParallelConfig(tp=tp))
        calls.clear(), prenorms.clear()
        assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == want, quantize
        others = (m.num_heads - m.num_heads // tp, m.num_kv_heads - max(m.num_kv_heads // tp, 1))
        assert calls and set(calls) == {others}, (quantize, set(calls))  # every decode step, every layer
        assert prenorms and all(t > 1 for t in prenorms), quantize  # the prompts alone all-reduce


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_served_pipeline_keeps_several_units_in_flight_and_matches_generate(info, world, checkpoint, mode):
    """The server under pp (rank 0 schedules, the others follow its slots): requests of
    different lengths, more than the batch holds, share the slots -- units of different
    requests are in the pipeline at once -- and each gets generate()'s tokens, a seeded
    sampled one too; a request cancelled while its unit is in flight frees its blocks only
    once the unit has left. Decode rows feed their tokens from the device (each request's
    lane), which reach the host a slot later. "static": decode units and units of fresh
    prompts replay each stage's fixed-shape steps (a graph's math, run eagerly), made
    before the first request."""
    from moe_infer.ranks import lead_or_follow
    from moe_infer.sampling import SamplingParams
    from moe_infer.scheduler import Request, Scheduler

    path, reference = checkpoint
    engine = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False,
                            parallel=ParallelConfig(pp=2, tp=world // 2))
    engine.eos = set()
    if info.device.type != "cuda":
        engine.decode_mode = mode
    scheduler = Scheduler(engine, num_blocks=64, block_size=4, max_batch=3)
    release = lead_or_follow(scheduler)
    if release is None:  # a follower: it ran every slot rank 0 sent
        return
    scheduler.warm_up()  # as the server's: after lead_or_follow, which made every rank's captures
    prefills = []  # the stage's fixed-shape prefills that ran
    for step in scheduler.runner._stage_prefills.values():
        step.run = lambda rows, hidden=None, run=step.run: prefills.append(len(rows)) or run(rows, hidden)
    lengths = [7, 3, 9, 5, 6]
    params = [SamplingParams()] * 4 + [SamplingParams(temperature=0.8, top_k=5, seed=11)]
    out = [[] for _ in range(6)]
    prompts = (PROMPTS + PROMPTS[:2])[:len(lengths)]
    reqs = [Request(p, sp, n, lambda k, d, i=i: out[i].append(d.get("token_id")) if k == "token" else None)
            for i, (p, sp, n) in enumerate(zip(prompts, params, lengths))]
    doomed = Request(PROMPTS[0], SamplingParams(), 50, lambda k, d: None)
    for r in reqs + [doomed]:
        scheduler.submit(r)
    busy, slot = [], scheduler.slots.slot  # units in the pipeline in each slot

    def counted(rows):
        busy.append(bool(rows) + sum(u is not None for u in scheduler.slots.inflight[:-1]))
        return slot(rows)
    scheduler.slots.slot = counted
    cancelled_in_flight = False
    # Prompt logprobs, asked for while units are in flight: the pipeline drains for its prefill.
    prompt_events = []
    scored = Request(PROMPTS[2], SamplingParams(), 4, lambda k, d: prompt_events.append(d) if k == "prompt" else
                     (out[-1].append(d.get("token_id")) if k == "token" else None), logprobs=1, prompt_logprobs=1)
    steps, deferred = 0, False
    try:
        while scheduler.waiting or scheduler.running:
            scheduler.step()
            steps += 1
            deferred |= bool(scheduler.inflight)  # a unit's tokens reach the host while the next slot runs
            if steps == 3:
                assert any(u is not None for u in scheduler.units)
                scheduler.submit(scored)
            if doomed.inflight and not doomed.cancelled and doomed.sampled >= 2:
                scheduler.cancel(doomed)
                cancelled_in_flight = True
                scheduler._schedule()
                assert doomed in scheduler.running and doomed.table  # its unit still writes its blocks
    finally:
        release()
    assert max(busy) == 2 and cancelled_in_flight and scheduler.blocks_in_use == 0 and deferred
    assert scheduler.free_lanes == list(range(3))  # every request's lane of runner.prev back
    assert len(prompt_events) == 1 and len(prompt_events[0]["logprobs"]) == len(PROMPTS[2])
    assert [t for t in out[-1] if t is not None] == reference.generate([PROMPTS[2]], max_new_tokens=4)[0].token_ids
    assert bool(scheduler.runner._stage_steps) == bool(prefills) == scheduler.runner.static
    for i, (p, sp, n) in enumerate(zip(prompts, params, lengths)):
        want = reference.generate([p], max_new_tokens=n, temperature=sp.temperature, top_k=sp.top_k,
                                  seed=sp.seed)[0].token_ids
        assert [t for t in out[i] if t is not None] == want, i


@pytest.mark.parametrize("checkpoint", ["qwen2_moe"], indirect=True)  # (the schedule is the same for every family)
def test_served_pipeline_ends_a_request_at_eos_while_its_next_token_is_in_flight(info, world, checkpoint):
    """Under pp the server learns of a unit's tokens a slot after the unit left, so a
    request whose token is EOS has already re-entered the pipeline: it finishes with the
    tokens before EOS, and keeps its blocks and lane until that unit has left."""
    from moe_infer.ranks import lead_or_follow
    from moe_infer.sampling import SamplingParams
    from moe_infer.scheduler import Request, Scheduler

    path, reference = checkpoint
    # A prompt whose continuation has a new token after its first: that token is EOS here.
    prompt, want = next((p, w) for p in PROMPTS for w in [reference.generate([p], max_new_tokens=8)[0].token_ids]
                        if any(t not in w[:i] for i, t in enumerate(w) if i >= 1))
    eos = next(t for i, t in enumerate(want) if i >= 1 and t not in want[:i])
    engine = moe_infer.load(path, device=info.device, dtype=torch.float32, progress=False,
                            parallel=ParallelConfig(pp=2, tp=world // 2))
    engine.eos = {eos}
    scheduler = Scheduler(engine, num_blocks=64, block_size=4, max_batch=3)
    release = lead_or_follow(scheduler)
    if release is None:  # a follower: it ran every slot rank 0 sent
        return
    out = []
    ending = Request(prompt, SamplingParams(), 8, lambda k, d: out.append(d["token_id"]) if k == "token" else None)
    others = [Request(p, SamplingParams(), 4, lambda k, d: None, ignore_eos=True) for p in PROMPTS[:2]]
    for r in [ending] + others:
        scheduler.submit(r)
    ended_in_flight = False
    try:
        while scheduler.waiting or scheduler.running:
            scheduler.step()
            ended_in_flight |= ending.finish is not None and ending.inflight and bool(ending.table)
    finally:
        release()
    assert ended_in_flight and ending.finish == "stop" and out == want[:want.index(eos)]
    assert scheduler.blocks_in_use == 0 and scheduler.free_lanes == list(range(3))


def test_glm4_moe_split_over_ranks_matches_one_process(info, world, tmp_path_factory):
    """GLM-4.5 (partial rotary, q/k norms and biases, sigmoid scores with a learned bias,
    grouped top-k, a scale, shared experts, a dense first layer) under tensor and expert
    parallelism gives the single process's logits and greedy tokens."""
    box = [str(tmp_path_factory.mktemp("glm")) if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        save_hf_model("glm4_moe", box[0], num_attention_heads=8, num_key_value_heads=4, hidden_size=64,
                      n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2)
    dist.broadcast_object_list(box, src=0)
    reference = moe_infer.load(box[0], device=info.device, dtype=torch.float32, progress=False)
    ref, ref_tokens = reference.logits(PROMPTS), [o.token_ids for o in reference.generate(PROMPTS, max_new_tokens=5)]
    for kw in (dict(tp=world), dict(dp=world, ep=world)):
        engine = moe_infer.load(box[0], device=info.device, dtype=torch.float32, progress=False,
                                parallel=ParallelConfig(**kw))
        assert rel_err(engine.logits(PROMPTS), ref) < 1e-4, kw
        assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=5)] == ref_tokens, kw
