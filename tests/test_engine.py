"""Engine behaviour on random-weight configs: cache consistency, batching, sampling, errors."""
import dataclasses

import pytest
import torch

import moe_infer
from moe_infer import ConfigError, ParallelConfig
from moe_infer.cli import main
from moe_infer.config_files import config_from_dict
from moe_infer.engine import Engine
from moe_infer.graphs import GRAPH_PRIMERS
from moe_infer.loader import _materialize
from moe_infer.model import Transformer
from moe_infer.runner import PagedRunner, Row

GPT_MOE = {  # GPT style: LayerNorm, GeLU, learned positions, parallel block, biases, top-1
    "model": dict(vocab_size=89, hidden_size=40, num_layers=4, num_heads=5, ffn_hidden=56, norm="layernorm",
                  activation="gelu", positions="learned", max_position=64, parallel_block=True,
                  tied_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "moe": dict(num_experts=5, top_k=1, expert_hidden=24, every=2),
}
LLAMA_MOE = {  # RoPE, GQA 3, sliding window, sigmoid router, shared expert, first layer dense
    "model": dict(vocab_size=97, hidden_size=36, num_layers=3, num_heads=6, num_kv_heads=2, ffn_hidden=44,
                  max_position=64, sliding_window=5, qk_norm="head"),
    "moe": dict(num_experts=7, top_k=3, expert_hidden=20, first_dense=1, score="sigmoid",
                shared_experts=2, shared_expert_hidden=8, shared_expert_gate=True),
    "engine": dict(max_batch_size=2),
}
PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 3], [58, 9, 7, 9]]


def engine_for(data, seed=0, eos=()):
    cfg = config_from_dict({**data, "engine": {**data.get("engine", {}), "seed": seed}})
    cfg.model.eos_token_ids = tuple(eos)
    with torch.device("meta"):
        model = Transformer(cfg)
    _materialize(model, torch.device("cpu"), torch.float32)
    model.init_random(seed)
    with torch.no_grad():  # larger weights than the default init, so outputs vary with input
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10)
    return Engine(model, cfg)


@pytest.mark.parametrize("data", [GPT_MOE, LLAMA_MOE], ids=["gpt-moe", "llama-moe"])
def test_cached_decode_agrees_with_full_forward(data):
    """Greedy tokens from prefill + cached decode (left-padded batch) are the argmax of a
    full forward over prompt + output (right-padded batch)."""
    engine = engine_for(data)
    outs = engine.generate(PROMPTS, max_new_tokens=6)
    full = [p + o.token_ids for p, o in zip(PROMPTS, outs)]
    logits = engine.logits(full)
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        pred = logits[i, len(p) - 1:len(full[i]) - 1].argmax(-1).tolist()
        assert pred == o.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1  # not a degenerate constant model


LLAMA_MOE_FULL = {**LLAMA_MOE, "model": {**LLAMA_MOE["model"], "sliding_window": None}}


@pytest.mark.parametrize("data", [GPT_MOE, LLAMA_MOE_FULL], ids=["gpt-moe", "llama-moe"])
def test_unpadded_prefill_runs_causal_and_matches_the_masked_one(data, monkeypatch):
    """Prompts of one length prefill with plain causal attention (no mask): over the paged
    cache, the same logits and cached keys and values as the same prompts prefilled under
    the mask (beside a shorter, left-padded one), and without a cache (Engine.logits) the
    same logits as the masked forward; decode from that cache agrees with a full forward."""
    engine = engine_for(data)
    model = engine.model
    ids = torch.tensor([[3, 14, 15, 9, 2, 6], [5, 3, 58, 9, 7, 9]])
    prompts = ids.tolist()
    runner = PagedRunner(engine, num_blocks=9, block_size=4, max_batch=3)
    causal, paged_context = [], model.paged_context
    monkeypatch.setattr(model, "paged_context", lambda *a: causal.append(a[4]) or paged_context(*a))  # (its causal)
    fresh = runner.forward_all([Row(prompts[0], 0, [0, 1]), Row(prompts[1], 0, [2, 3])])  # [2, 6, V]
    padded = runner.forward_all([Row(prompts[0], 0, [4, 5]), Row([7, 1], 0, [6]), Row(prompts[1], 0, [8, 7])])
    assert causal == [True, False]
    torch.testing.assert_close(fresh, padded[[0, 2]], rtol=1e-5, atol=1e-5)
    cache = runner.cache
    for a, b in (([0, 1], [4, 5]), ([2, 3], [8, 7])):  # each prompt's blocks in the two forwards
        rows_a, rows_b = cache.slots(a, 0, 6), cache.slots(b, 0, 6)
        torch.testing.assert_close(cache.k[:, rows_a], cache.k[:, rows_b], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache.v[:, rows_a], cache.v[:, rows_b], rtol=1e-5, atol=1e-6)
    valid, pos = torch.ones_like(ids, dtype=torch.bool), torch.arange(6).expand(2, 6)
    assert [model.context(pos, valid, no_padding=n).causal for n in (False, True)] == [False, True]
    uncached = engine.logits(ids)  # no mask given: causal
    torch.testing.assert_close(uncached, engine.logits(prompts), rtol=1e-5, atol=1e-5)  # id lists: masked
    torch.testing.assert_close(uncached, fresh, rtol=1e-5, atol=1e-5)
    outs = engine.generate(prompts, max_new_tokens=5)
    full = [p + o.token_ids for p, o in zip(prompts, outs)]
    logits = engine.logits(full)  # id lists get a mask: the masked path
    for i, o in enumerate(outs):
        assert logits[i, 5:5 + len(o.token_ids)].argmax(-1).tolist() == o.token_ids


@pytest.mark.parametrize("data", [GPT_MOE, LLAMA_MOE], ids=["gpt-moe", "llama-moe"])
def test_static_shape_decode_equals_growing_decode(data):
    """The fixed-shape decode step (the one CUDA graphs capture: rows padded to a power of
    two, keys to a power-of-two bucket, every input in device buffers) gives the eager
    step's tokens, greedy and seeded sampling alike, and its in-step argmax is the argmax of
    its logits."""
    engine = engine_for(data)
    eager = engine.generate(PROMPTS, max_new_tokens=7)
    sampled = engine.generate(PROMPTS, max_new_tokens=7, temperature=0.9, seed=4)
    assert not engine.runner._steps  # the eager runner makes no fixed-shape step
    engine.decode_mode = "static"
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=7)] == [o.token_ids for o in eager]
    assert [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=7, temperature=0.9, seed=4)] == \
        [o.token_ids for o in sampled]
    steps = engine.runner._steps
    assert steps and all(b & (b - 1) == 0 and s % engine.BLOCK_SIZE == 0 for b, s in steps)
    step = next(iter(steps.values()))
    rows = [Row([PROMPTS[0][0]], 3, list(range(step.blocks)))]
    logits, greedy = step.run(rows)
    assert torch.equal(greedy, logits.argmax(-1)) and logits.shape == (1, data["model"]["vocab_size"])


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_on_the_gpu():
    """On a GPU generate() replays a captured decode step: the same tokens as eager decode
    (embedded model, bf16), and bit-identical logits to the same step run without the graph."""
    engine = moe_infer.load(device="cuda", progress=False)
    prompts = ["Shall I compare thee to a summer's day?", "When", "Let me not to the marriage of true minds"]
    assert engine.decode_mode == "graph"
    graphed = engine.generate(prompts, max_new_tokens=40)
    step = next(s for s in engine.runner._steps.values() if s.graph is not None)
    engine.decode_mode = "eager"
    assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=40)] == [o.token_ids for o in graphed]
    rows = [Row([i + 1], 5 + i, list(range(i * step.blocks, (i + 1) * step.blocks))) for i in range(step.batch)]
    replayed = [t.clone() for t in step.run(rows)]
    graphs, step.graphs = step.graphs, None  # the same step, eagerly, on the same cache
    direct = step.run(rows)
    step.graphs = graphs
    assert torch.equal(replayed[0], direct[0]) and torch.equal(replayed[1], direct[1])


@pytest.mark.gpu
def test_graphs_primed_once_before_the_first_capture(monkeypatch):
    """The runner makes its priming graphs once, before its first decode step is captured
    (the first graphs a process makes replay slower), and not again for later buckets."""
    import moe_infer.runner as runner_mod

    calls, captured = [], []
    real_prime, real_step = runner_mod.prime_cuda_graphs, runner_mod.PagedDecodeStep

    def prime(device, count=GRAPH_PRIMERS):
        assert not captured, "primed after a decode step was captured"
        calls.append(count)
        real_prime(device, count)

    def step(*args, **kwargs):
        captured.append(args[1:3])
        return real_step(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "prime_cuda_graphs", prime)
    monkeypatch.setattr(runner_mod, "PagedDecodeStep", step)
    engine = moe_infer.load("tiny-moe", device="cuda", progress=False)
    engine.generate([[1, 2, 3]], max_new_tokens=3)
    engine.generate([[1, 2, 3]] * 3, max_new_tokens=70)  # another batch and key bucket
    assert calls == [GRAPH_PRIMERS] and len(captured) == 3  # (1, 64), then (4, 64) and (4, 128)


@pytest.mark.parametrize("data", [GPT_MOE, LLAMA_MOE], ids=["gpt-moe", "llama-moe"])
@pytest.mark.parametrize("budget", [1, 5, 18], ids=["token-pieces", "row-pieces", "row-groups"])
def test_prefill_in_pieces_gives_the_tokens_of_one_forward(data, budget):
    """engine.prefill_tokens bounds a prefill forward: rows in groups, a row longer than the
    budget in pieces (each attending over the slots its earlier pieces cached). The greedy
    tokens and the cache equal one whole-batch forward's, in both decode modes."""
    prompts = PROMPTS + [[7, 1, 8, 2, 8, 1, 8, 2, 8], [4, 4]]
    for mode in ("eager", "static"):
        whole = engine_for(data)
        whole.decode_mode = mode
        whole.config.engine.max_batch_size = len(prompts)
        parts = engine_for(data)
        parts.decode_mode = mode
        parts.config.engine.max_batch_size = len(prompts)
        parts.config.engine.prefill_tokens = budget
        calls = []
        forward = parts.model.forward
        parts.model.forward = lambda ids, *a, **k: calls.append(ids.numel()) or forward(ids, *a, **k)
        want = [o.token_ids for o in whole.generate(prompts, max_new_tokens=1)]
        got = [o.token_ids for o in parts.generate(prompts, max_new_tokens=1)]
        assert got == want
        assert max(calls) <= budget
        assert len(calls) > 1 and sum(calls) >= sum(map(len, prompts))
        want = [o.token_ids for o in whole.generate(prompts, max_new_tokens=6)]
        assert [o.token_ids for o in parts.generate(prompts, max_new_tokens=6)] == want


def test_a_captured_steps_outputs_are_copied_before_its_next_replay(graph_outputs):
    """A captured step returns its output buffers, which its next replay rewrites (the
    ``graph_outputs`` stand-in on the CPU). A prompt whose last prefill piece is one token,
    then a one-token prompt through the same step, still each get their own first token."""
    prompts = [[7, 1, 8, 2, 8, 1, 8, 2, 8], [4]]
    engine = engine_for(LLAMA_MOE)
    want = [o.token_ids for o in engine.generate(prompts, max_new_tokens=3)]  # eager: no fixed-shape step
    engine.decode_mode = "static"
    engine.config.engine.prefill_tokens = 4  # row 0 in pieces of 4, 4 and 1; row 1 after it
    assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=3)] == want
    assert want[0][0] != want[1][0]  # the two rows' first tokens differ: a mix-up would show


@pytest.mark.gpu
def test_prefill_in_pieces_on_the_gpu():
    """The GPU prefill kernels (the fused QKV epilogue writing the pool rows of some rows, a
    piece starting past position 0, a causal piece and a masked one) give the whole
    forward's greedy tokens (embedded model, graph decode). In float32: in bf16 the causal
    and the masked attention kernels round differently, and 24 greedy tokens of a small
    model can part at a near-tie."""
    engine = moe_infer.load(device="cuda", dtype="float32", progress=False)
    prompts = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
               "When", "Let me not to the marriage of true minds admit impediments."]
    whole = [o.token_ids for o in engine.generate(prompts, max_new_tokens=24)]
    for budget in (7, 40):  # pieces of one row; groups of two rows
        engine.config.engine.prefill_tokens = budget
        assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=24)] == whole


def test_completions_carry_their_host_timings():
    engine = engine_for(GPT_MOE)
    outs = engine.generate(PROMPTS, max_new_tokens=4)
    for o in outs:
        assert o.time_to_first_token_s > 0 and o.inter_token_s > 0 and len(o.token_ids) == 4
    one = engine.generate(PROMPTS[:1], max_new_tokens=1)[0]
    assert one.time_to_first_token_s > 0 and one.inter_token_s is None


def test_batch_larger_than_max_batch_size_equals_one_by_one():
    engine = engine_for(LLAMA_MOE)  # max_batch_size 2, three prompts
    together = engine.generate(PROMPTS, max_new_tokens=5)
    alone = [engine.generate([p], max_new_tokens=5)[0] for p in PROMPTS]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_stops_at_eos_without_returning_it():
    probe = engine_for(GPT_MOE).generate([PROMPTS[0]], max_new_tokens=6)[0].token_ids
    eos = probe[2]
    out = engine_for(GPT_MOE, eos=[eos]).generate([PROMPTS[0]], max_new_tokens=6)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == probe[:probe.index(eos)]


def test_sampling_is_seeded_and_filters():
    engine = engine_for(GPT_MOE)
    greedy = engine.generate(PROMPTS, max_new_tokens=6)
    a = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.5, seed=7)
    b = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.5, seed=7)
    c = engine.generate(PROMPTS, max_new_tokens=6, temperature=1.5, seed=8)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    for kw in (dict(top_k=1), dict(top_p=1e-6)):  # both leave only the argmax
        out = engine.generate(PROMPTS, max_new_tokens=6, temperature=2.0, seed=3, **kw)
        assert [o.token_ids for o in out] == [o.token_ids for o in greedy]


def test_top_k_samples_only_among_the_k_best():
    from moe_infer.sampling import SamplingParams, knobs, sample_rows

    logits = torch.randn(4, 50)
    allowed = torch.topk(logits, 3).indices
    for n in range(20):
        tok = sample_rows(logits, [knobs(SamplingParams(temperature=5.0, top_k=3), i, n) for i in range(4)])
        assert (allowed == tok[:, None]).any(1).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompts=[[]]), r"prompts\[0\]: empty prompt"),
    (dict(prompts=[[1, 2], ""]), r"prompts\[1\]: empty prompt"),
    (dict(prompts=[[1] * 60], max_new_tokens=8), r"prompts\[0\]: 60 prompt tokens \+ max_new_tokens=8 exceed max_seq_len=64"),
    (dict(prompts=[[1, 500]]), r"prompts\[0\]: token id 500 outside the vocabulary \[0, 89\)"),
    (dict(prompts=["text"]), r"prompts\[0\]: this model has no tokenizer"),
    (dict(prompts=[[1.5, 2]]), r"prompts\[0\]: expected a string or a list of int token ids"),
    (dict(prompts=[[1, 2], [3, True]]), r"prompts\[1\]: expected a string or a list of int token ids"),
    (dict(prompts=[[2, 2 ** 70, -1]]), r"prompts\[0\]: token id 1180591620717411303424 outside the vocabulary"),
    (dict(prompts=[]), r"prompts: expected a string"),
    (dict(temperature=-1.0), r"temperature=-1\.0: expected a number in \[0, 100\]"),
    (dict(top_p=0.0), r"top_p=0\.0: expected a number in \(0, 1\]"),
    (dict(top_k=-2), r"top_k=-2: expected an integer >= 0"),
    (dict(max_new_tokens=0), r"max_new_tokens=0: expected an integer >= 1"),
    (dict(seed="x"), r"seed='x': expected an integer"),
])
def test_bad_generate_arguments(kwargs, match):
    engine = engine_for(GPT_MOE)
    kwargs = {"prompts": [[1, 2, 3]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)


def test_multi_rank_layout_in_one_process_is_refused():
    with pytest.raises(ConfigError, match=r"tp=2 \* dp=1 \* pp=1 needs 2 ranks, but this job has 1; launch with mpirun -n 2"):
        moe_infer.load("tiny-moe", parallel=ParallelConfig(tp=2))
    with pytest.raises(ConfigError, match=r"parallel\.ep=4: expected a divisor of moe\.num_experts=6"):
        moe_infer.load("tiny-moe", parallel=ParallelConfig(ep=4, dp=4))


def test_cli_generate_and_errors(capsys):
    assert main(["generate", "--config", "tiny-moe", "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out.split()
    assert out[:3] == ["1", "2", "3"] and len(out) == 7
    assert main(["generate", "--config", "tiny-moe", "--prompt-ids", "1", "--top-p", "2"]) == 2
    assert "moe-infer: error: top_p=2.0: expected a number in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--config", "nope", "--prompt", "x"]) == 2
    assert "'nope': not a checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "generate" in capsys.readouterr().out


def test_int8_experts_swap_in_and_stay_close():
    from moe_infer.experts import Experts, Int8Experts, quantize_experts

    engine = engine_for(LLAMA_MOE)
    before = engine.logits(PROMPTS)
    quantize_experts(engine.model)
    kinds = {type(m) for m in engine.model.modules() if isinstance(m, Experts)}
    assert kinds == {Int8Experts}
    moe = next(m for m in engine.model.modules() if isinstance(m, Int8Experts))
    assert moe.w13.dtype == torch.int8 and moe.w13_scale.shape == moe.w13.shape[:2]
    after = engine.logits(PROMPTS)
    err = ((after - before).norm() / before.norm()).item()
    assert 0 < err < 3e-2


def test_padding_rows_of_fixed_buffers_run_through_an_expert_the_real_rows_use():
    """At decode sizes most rows of a fixed-capacity all-to-all are padding (tag -1): they
    go to an expert that real rows read anyway, so no expert's weights are read for them
    alone (expert 0 where no row is real); exact-size exchanges have no padding."""
    from moe_infer.dispatch import ExpertParallelDispatcher, Sent

    class Recording:
        def fused(self, x, ids, weights, capacity=None, maps=None):
            self.ids = ids.flatten().tolist()
            return x

    def compute(tags, padded):
        experts = Recording()
        sent = Sent(torch.zeros(len(tags), 4), torch.tensor(tags)[:, None], [], [], None, None, None, padded)
        ExpertParallelDispatcher.compute(sent, experts)
        return experts.ids

    assert compute([-1, 3, -1, 1, -1], True) == [3, 3, 3, 1, 3]
    assert compute([-1, -1], True) == [0, 0]
    assert compute([2, 0], False) == [2, 0]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_pipeline_stages_are_contiguous_and_as_balanced_as_any_split(stages):
    """Every split of the blocks into contiguous stages of one block or more costs at least
    as much on its costliest stage (the LM head on the last) as the one chosen."""
    import itertools

    from moe_infer.config_files import load_preset
    from moe_infer.model import layer_cost, stage_layers

    cfg = load_preset("olmoe-1b-7b")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=7))
    head = cfg.model.vocab_size * cfg.model.hidden_size

    def worst(bounds):
        return max(sum(layer_cost(cfg, i) for i in r) + (head if k == len(bounds) - 1 else 0)
                   for k, r in enumerate(bounds))
    got = stage_layers(cfg, stages)
    assert [i for r in got for i in r] == list(range(7)) and all(len(r) for r in got)
    splits = [[range(a, b) for a, b in zip((0, *cuts), (*cuts, 7))]
              for cuts in itertools.combinations(range(1, 7), stages - 1)]
    assert worst(got) == min(worst(b) for b in splits)


def test_each_pipeline_stage_holds_only_its_own_weights():
    from comm import Group, ParallelGroups
    from moe_infer.config_files import load_preset
    from moe_infer.model import Transformer, stage_layers

    cfg = load_preset("tiny-moe")
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=2))
    one = Group.alone()
    names = []
    for stage in (0, 1):
        groups = ParallelGroups(one, one, one, one, one, pp=Group(None, stage, 2, (0, 1)))
        with torch.device("meta"):
            names.append({n.split(".")[0] + (f".{n.split('.')[1]}" if n.startswith("layers.") else "")
                          for n, _ in Transformer(cfg, groups).named_parameters()})
    blocks = stage_layers(cfg, 2)
    assert names[0] == {"embed"} | {f"layers.{i}" for i in blocks[0]}
    assert names[1] == {"norm", "lm_head"} | {f"layers.{i}" for i in blocks[1]}
