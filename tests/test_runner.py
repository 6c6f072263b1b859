"""The runner (generate()'s and the server's): the fixed-shape decode step (what a CUDA graph replays on a GPU,
run eagerly here) gives the logits of the eager paged forward, for rows of different cache
depths and block tables, padded to its bucket; the scheduler's greedy outputs through it
equal generate()'s."""
import random

import pytest
import torch

import moe_infer
from moe_infer.runner import PagedRunner, Row
from moe_infer.scheduler import Request, Scheduler
from moe_infer.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return moe_infer.load("tiny-moe", progress=False)


def prefill(runner, rng, lengths, vocab):
    """Caches random prompts of ``lengths`` in scattered blocks -> their rows' (tokens, table)."""
    free = list(range(runner.cache.num_blocks))
    rng.shuffle(free)
    seqs = []
    for n in lengths:
        need = -(-(n + 1) // runner.block_size)
        table, free = free[:need], free[need:]
        tokens = [rng.randrange(vocab) for _ in range(n + 1)]
        runner.forward([Row(tokens[:n], 0, table)])
        seqs.append((tokens, table))
    return seqs


@pytest.mark.parametrize("lengths", [[5], [3, 17, 9], [1, 40, 2, 33, 64]])
def test_fixed_shape_decode_step_equals_the_eager_forward(engine, lengths):
    runner = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=8)
    seqs = prefill(runner, random.Random(len(lengths)), lengths, engine.config.model.vocab_size)
    rows = [Row([tokens[n]], n, table) for (tokens, table), n in zip(seqs, lengths)]
    k_before = runner.cache.k.clone()
    eager = runner.forward(rows)
    k_eager = runner.cache.k.clone()
    runner.cache.k.copy_(k_before)
    runner.static = True
    step = runner.step_for(len(rows), max(n + 1 for n in lengths))
    assert step.batch >= len(rows) and step.keys >= max(lengths) + 1 and step.keys % runner.block_size == 0
    static = runner.forward(rows)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    written = runner.cache.k[:, :runner.cache.trash]  # the padding rows' writes land in the trash slot only
    torch.testing.assert_close(written, k_eager[:, :runner.cache.trash])


@pytest.mark.parametrize("cached", [False, True], ids=["fresh-right-padded", "cached-left-padded"])
def test_an_eager_forward_over_rows_of_several_lengths_feeds_only_real_tokens_to_per_token_layers(
        engine, cached, monkeypatch):
    """Rows of different lengths in one eager forward: every per-token layer (the
    attention's QKV and output projections, the experts) runs on the real tokens alone, not
    the padding, and each row's last-token logits and cached keys are those of the row run
    by itself."""
    rng = random.Random(7)
    vocab, lengths = engine.config.model.vocab_size, [3, 11, 1, 7]
    runner = PagedRunner(engine, num_blocks=64, block_size=4, max_batch=8)
    tables = [[4 * i + j for j in (3, 1, 0, 2)] for i in range(len(lengths))]  # 16 slots each, scattered
    start = 5 if cached else 0
    if cached:  # a cached prefix: the rows are left-padded then, else right-padded
        for table in tables:
            runner.forward([Row([rng.randrange(vocab) for _ in range(start)], 0, table)])
    rows = [Row([rng.randrange(vocab) for _ in range(n)], start, table) for n, table in zip(lengths, tables)]
    k_before = runner.cache.k.clone()
    alone = []
    for row in rows:
        alone.append(runner.forward([row]))
        runner.cache.k.copy_(k_before)
    seen = []
    for block in engine.model.layers:
        for layer in (block.attn.qkv_proj, block.attn.o_proj, block.ffn):
            monkeypatch.setattr(layer, "forward", lambda x, *a, f=layer.forward, **k: seen.append(x.shape[:-1].numel())
                                or f(x, *a, **k))
    together = runner.forward(rows)
    assert seen == [sum(lengths)] * 3 * len(engine.model.layers)  # not 4 rows x 11, padding counted
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-5)
    k_together = runner.cache.k.clone()
    runner.cache.k.copy_(k_before)
    for row in rows:
        runner.forward([row])
    torch.testing.assert_close(k_together[:, :runner.cache.trash], runner.cache.k[:, :runner.cache.trash])


@pytest.mark.parametrize("window", [None, 6], ids=["full", "sliding-window"])
@pytest.mark.parametrize("lengths", [[5], [3, 17, 9], [1, 40, 2, 33, 20]])
def test_fixed_shape_prefill_equals_the_masked_forward(engine, lengths, window, monkeypatch):
    """Fresh prompts of different lengths, prefilled right-padded (the fixed-shape step
    padded to its bucket, and the eager forward) give the last-token logits and the cached
    keys and values of the left-padded masked forward: causal over each row's own keys, or
    under the mask where a sliding window applies."""
    monkeypatch.setattr(engine.config.model, "sliding_window", window)
    runner = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=8)
    rng = random.Random(len(lengths))
    free = list(range(runner.cache.num_blocks))
    rng.shuffle(free)
    rows = []
    for n in lengths:
        need = -(-n // runner.block_size)
        rows.append(Row([rng.randrange(engine.config.model.vocab_size) for _ in range(n)], 0, free[:need]))
        free = free[need:]
    masked = runner.forward_all(rows)[:, -1]  # left-padded: each token's keys masked
    cached = runner.cache.k.clone(), runner.cache.v.clone()
    trash = runner.cache.trash
    for static in (False, True):
        runner.cache.k.zero_()
        runner.cache.v.zero_()
        runner.static = static
        logits, ids = runner.decode(rows)
        torch.testing.assert_close(logits, masked, rtol=1e-5, atol=1e-5)
        assert ids.tolist() == masked.argmax(-1).tolist()
        for got, want in zip((runner.cache.k, runner.cache.v), cached):  # padding wrote only the trash slot
            torch.testing.assert_close(got[:, :trash], want[:, :trash], rtol=1e-5, atol=1e-6)
    (b, t), = runner._prefills  # the fixed-shape step ran, its bucket padded
    assert b >= len(rows) and t >= max(lengths) and b * t <= runner.prefill_tokens


def test_sampled_first_tokens_through_the_fixed_shape_prefill_equal_the_eager_ones():
    """Seeded sampling requests: their first tokens, drawn after the fixed-shape prefill
    from its logits, and the rest equal the eager forward's."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    prompts = [[5, 9, 2, 7, 3], [11, 3], [42, 8, 8, 1, 6, 2, 9]]

    def run(static):
        scheduler = Scheduler(engine, num_blocks=64, block_size=8, max_batch=4)
        scheduler.runner.static = static
        reqs = [Request(p, SamplingParams(temperature=1.3, top_k=20, seed=11 + i), 6, lambda *a: None)
                for i, p in enumerate(prompts)]
        _serve_all(scheduler, reqs)
        return [r.generated for r in reqs], set(scheduler.runner._prefills)

    (fixed, buckets), (eager, _) = run(True), run(False)
    assert fixed == eager and buckets
    assert len({tuple(g) for g in fixed}) > 1


def test_prefill_buckets_and_the_rows_that_take_them(engine):
    runner = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=6)
    runner.static, runner.prefill_tokens, runner.HALF_STEPS = True, 64, 32
    assert runner.prefill_widths() == [16, 32, 48, 64]
    assert runner.prefill_step_for(2, 20).width == 32 and runner.prefill_step_for(3, 20) is None  # 4 x 32 > 64
    assert runner.prefill_step_for(1, 65) is None
    runner.capture_all()
    assert set(runner._prefills) == {(1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (1, 48), (1, 64)}
    made = dict(runner._prefills)
    for rows in ([Row([1, 2, 3], 0, [0]), Row([4, 5], 3, [1])],  # a row with keys cached before it
                 [Row([1, 2, 3], 0, [0], src=0)]):  # a token fed from the device
        runner.prev.zero_()
        runner.decode(rows)  # eager: neither is a fresh prompt the step can take
    assert runner._prefills == made


def test_released_steps_are_made_again_at_their_next_use(engine):
    """release_graphs (before a job destroys its process group: NCCL waits for every graph
    holding its collectives) drops every step; a later forward makes its own again and
    gives the same logits."""
    runner = PagedRunner(engine, num_blocks=16, block_size=4, max_batch=2)
    runner.static = True
    rows = [Row([3], 5, [0, 1]), Row([7], 2, [2])]
    runner.decode([Row([1, 2, 3, 4, 5], 0, [0, 1]), Row([6, 7], 0, [2])])  # fills the rows' keys
    before = runner.decode(rows)[0].clone()
    runner.capture_all()
    assert runner._steps and runner._prefills
    runner.release_graphs()
    assert not (runner._steps or runner._stage_steps or runner._prefills)
    torch.testing.assert_close(runner.decode(rows)[0], before)
    assert list(runner._steps) == [runner.decode_bucket(2, 6)]


def test_rows_beyond_every_bucket_take_the_eager_forward(engine):
    runner = PagedRunner(engine, num_blocks=8, block_size=4, max_batch=2)
    runner.static = True
    assert runner.step_for(3, 5) is None  # more rows than the largest batch bucket
    assert runner.step_for(2, runner.max_keys + 1) is None
    assert runner.step_for(2, runner.max_keys).keys >= runner.max_keys


def test_scheduler_through_the_fixed_shape_step_matches_generate():
    # float32 on the CPU: in bf16 a prefill chunk and a whole prompt take attention kernels
    # that round differently, and a random model's near-ties then pick other tokens (the
    # GPU test below compares the server's graph and eager paths instead).
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=96, block_size=8, max_batch=4)
    scheduler.runner.static = True
    rng = random.Random(0)
    prompts = [[rng.randrange(engine.config.model.vocab_size) for _ in range(rng.randrange(2, 30))] for _ in range(6)]
    done = {}
    reqs = [Request(p, SamplingParams(), 12, lambda kind, data, i=i: done.setdefault(i, []).append((kind, data)))
            for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.submit(r)
    while scheduler.waiting or scheduler.running:
        scheduler.step()
        lanes = [r.src for r in scheduler.running if r.finish is None]  # each one's row of runner.prev
        assert len(set(lanes)) == len(lanes) and all(0 <= lane < 4 for lane in lanes)
    assert scheduler.free_lanes == [0, 1, 2, 3]  # six requests through four lanes, each given back
    assert len(scheduler.runner._steps) >= 1  # decode steps went through the fixed-shape path
    for r, p in zip(reqs, prompts):
        assert r.generated == engine.generate([p], max_new_tokens=12)[0].token_ids[:len(r.generated)]
        assert r.finish in ("stop", "length")


def test_a_prefill_step_computes_at_most_prefill_chunk_tokens():
    """Rows x width of every prefill forward stays within server.prefill_chunk: the oldest
    prefilling request first (a longer one alone, in pieces), then every later one whose
    whole prompt fits beside it; the tokens are generate()'s."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=200, block_size=8, max_batch=8, prefill_chunk=40)
    scheduler.runner.static = True
    forwards = []
    decode = scheduler.runner.decode
    scheduler.runner.decode = lambda rows: forwards.append([len(r.tokens) for r in rows]) or decode(rows)
    rng = random.Random(1)
    lengths = [30, 5, 12, 50, 8, 3, 17, 9]
    prompts = [[rng.randrange(engine.config.model.vocab_size) for _ in range(n)] for n in lengths]
    reqs = [Request(p, SamplingParams(), 4, lambda *a: None) for p in prompts]
    _serve_all(scheduler, reqs)
    prefills = [f for f in forwards if max(f) > 1]
    assert all(len(f) * max(f) <= 40 for f in prefills)
    # 30 + 5 would compute 2 x 30 tokens; the 50-token prompt's first piece goes alone
    assert prefills == [[30], [5, 12, 8], [40], [10, 3, 9], [17]]
    for r, p in zip(reqs, prompts):
        assert r.generated == engine.generate([p], max_new_tokens=4)[0].token_ids


def test_a_prefill_of_fresh_prompts_stays_within_a_fixed_shape_bucket():
    """A fresh prompt joins a step's prefill only where the rows stay within a fixed-shape
    bucket (rows x width within the runner's prefill_tokens, padding counted), though the
    step's prefill_chunk would take it; it prefills at the next step."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=64, block_size=8, max_batch=4, prefill_chunk=40)
    scheduler.runner.static, scheduler.runner.prefill_tokens = True, 32
    forwards = []
    decode = scheduler.runner.decode
    scheduler.runner.decode = lambda rows: forwards.append([len(r.tokens) for r in rows]) or decode(rows)
    prompts = [[3] * 5, [4] * 12, [5] * 8, [6] * 3]
    reqs = [Request(p, SamplingParams(), 3, lambda *a: None) for p in prompts]
    _serve_all(scheduler, reqs)
    assert [f for f in forwards if max(f) > 1] == [[5, 12], [8, 3]]  # 3 x 12 fits 40, but only a 4 x 16 bucket
    assert set(scheduler.runner._prefills) == {(2, 16)}
    for r, p in zip(reqs, prompts):
        assert r.generated == engine.generate([p], max_new_tokens=3)[0].token_ids


def test_a_new_requests_first_token_is_delivered_in_the_step_that_prefills_it(graph_outputs):
    """A step that ends a prefill beside decoding rows delivers the new request's first
    token at once (its copy is queued before the decode forward) where no other prompt
    waits; the decoding rows' tokens of that step arrive with the next step, as before.
    Tokens are generate()'s."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=32, block_size=8, max_batch=4)
    scheduler.runner.static = True
    a = Request([5, 9, 2, 7], SamplingParams(), 8, lambda *e: None)
    b = Request([11, 3, 8], SamplingParams(), 8, lambda *e: None)
    scheduler.submit(a)
    scheduler.step()
    scheduler.step()
    assert len(a.generated) == 1 and [s.reqs for s in scheduler.inflight] == [[a]]
    scheduler.submit(b)
    scheduler.step()  # B's prefill, then A's decode
    assert len(b.generated) == 1 and len(a.generated) == 2 and [s.reqs for s in scheduler.inflight] == [[a]]
    # With another prompt waiting, C's first token travels with A's and B's tokens instead.
    c, d = (Request(p, SamplingParams(), 8, lambda *e: None) for p in ([4, 4, 2], [6, 1]))
    scheduler.max_batch = 3
    for r in (c, d):
        scheduler.submit(r)
    scheduler.step()
    assert not c.generated and [s.reqs for s in scheduler.inflight] == [[c], [a, b]]
    _serve_all(scheduler, [])
    for r in (a, b, c, d):
        assert r.generated == engine.generate([r.prompt], max_new_tokens=8)[0].token_ids[:len(r.generated)]
    assert len(b.generated) > 1


def test_a_one_token_prompt_joining_a_decode_step_of_the_same_bucket(graph_outputs):
    """A captured step returns its output buffers, which its next replay rewrites (the
    ``graph_outputs`` stand-in on the CPU). A one-token prompt's prefill and one decoding
    row run the same (1 row) step in one scheduler step: each request still gets
    generate()'s tokens."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=32, block_size=8, max_batch=2)
    scheduler.runner.static = True
    # A ends first; C (one token) then prefills beside B's decode step, both 1-row steps.
    work = [([5, 9, 2, 7, 3], 3), ([11], 10), ([42], 6)]
    reqs = [Request(p, SamplingParams(), n, lambda *a: None) for p, n in work]
    _serve_all(scheduler, reqs)
    for r, (p, n) in zip(reqs, work):
        assert r.generated == engine.generate([p], max_new_tokens=n)[0].token_ids[:len(r.generated)]
    assert len(reqs[2].generated) > 1


def test_prefill_warm_up_leaves_the_cache_as_requests_need_it():
    """The server's start-up prefills (one per width, so that kernels compile before any
    request waits) write into free blocks; requests served after them get generate()'s
    tokens."""
    engine = moe_infer.load("tiny-moe", device="cpu", progress=False)
    scheduler = Scheduler(engine, num_blocks=24, block_size=8, max_batch=4)
    widths = []
    run = scheduler.runner._run
    scheduler.runner._run = lambda rows, last_only: widths.append(len(rows[0].tokens)) or run(rows, last_only)
    scheduler.runner.warm_up([1, 64, 96, 10_000])  # the last fits no cache: skipped
    assert widths == [1, 64, 96]
    prompts = [[5, 9, 2, 7], [11, 3] * 20]
    reqs = [Request(p, SamplingParams(), 10, lambda *a: None) for p in prompts]
    _serve_all(scheduler, reqs)
    for r, p in zip(reqs, prompts):
        assert r.generated == engine.generate([p], max_new_tokens=10)[0].token_ids[:len(r.generated)]


def test_step_rows_travel_as_one_int64_tensor():
    pytest.importorskip("fastapi")
    from moe_infer.ranks import FORWARD, SLOT, fed_tokens, pack_rows, unpack_rows

    rows = [Row([1, 2, 3], 0, [5, 6]), Row([9], 17, [1, 2, 3, 4]), Row([7, 7], 4, [0])]
    packed = pack_rows(rows)
    assert packed.dtype == torch.int64 and packed.dim() == 1
    assert unpack_rows(packed) == (rows, FORWARD) and unpack_rows(pack_rows(None)) is None
    assert fed_tokens(rows) == 0 and fed_tokens(None) == 0
    # A decode row that feeds its token from a lane of ``runner.prev``: the lanes up to the
    # last one fed follow the rows to every rank.
    fed = rows + [Row([0], 8, [2], 5), Row([0], 3, [3], 2)]
    assert unpack_rows(pack_rows(fed)) == (fed, FORWARD) and fed_tokens(fed) == 6
    assert unpack_rows(pack_rows(rows, SLOT)) == (rows, SLOT) and unpack_rows(pack_rows([], SLOT)) == ([], SLOT)
    # A row that samples samples on the followers too (the same variant of a captured step),
    # with knobs of their own: their draws are not used.
    rows[1].sample = (11, 3, 5, 0.8, 0.9)
    got, _ = unpack_rows(pack_rows(rows))
    assert [r.sample is not None for r in got] == [False, True, False] and got[1].tokens == [9]


def _serve_all(scheduler, reqs):
    for r in reqs:
        scheduler.submit(r)
    while scheduler.waiting or scheduler.running or scheduler.inflight:
        scheduler.step()


def test_requests_ending_while_the_next_step_runs_leave_the_rest_exact():
    """On one rank the next step is launched before the host reads this one's tokens, so a
    request that a stop string or max_tokens ends has already joined it: its extra token
    must be dropped and its KV write must hurt nobody. Every request's events match what
    the host-synchronous schedule (the mpirun one) gives, and the texts match generate()."""
    engine = moe_infer.load("default", progress=False)
    prompts = ["Shall I compare thee", "When in disgrace with fortune", "Let me", "From fairest creatures",
               "Look in thy glass", "Music to hear"]
    stops = [[], [" the"], [], ["e"], [], [","]]
    lengths = [14, 20, 5, 18, 1, 9]

    def run(pipelined: bool):
        scheduler = Scheduler(engine, num_blocks=40, block_size=8, max_batch=3)
        scheduler.runner.static = True
        if not pipelined:
            scheduler.broadcast = lambda rows, mode: None  # as rank 0 of an mpirun job
        events = [[] for _ in prompts]
        reqs = [Request(engine.encode(p)[0], SamplingParams(), n, lambda k, d, i=i: events[i].append((k, d)), stop=s)
                for i, (p, s, n) in enumerate(zip(prompts, stops, lengths))]
        _serve_all(scheduler, reqs)
        assert scheduler.blocks_in_use == 0 and not scheduler.running
        return events

    pipelined, synchronous = run(True), run(False)
    assert pipelined == synchronous
    for p, s, n, ev in zip(prompts, stops, lengths, pipelined):
        assert [k for k, _ in ev].count("done") == 1 and ev[-1][0] == "done"
        text = "".join(d["text"] for k, d in ev if k == "token")
        full = engine.generate([p], max_new_tokens=n)[0].text
        cut = min((full.find(x) for x in s if x in full), default=-1)
        assert text == (full[:cut] if cut >= 0 else full), p
        assert ev[-1][1]["finish_reason"] == ("stop" if cut >= 0 else "length")


def test_incremental_detokenizing_equals_a_full_decode():
    from moe_infer.tokenizer import decode_delta

    tok = moe_infer.load("default", progress=False).tokenizer
    rng = random.Random(3)
    text = "Shall I — compare thee to a ßummer’s day? 夏の日 🌞 naïve"
    for trial in range(20):
        ids = tok.encode(text) if trial == 0 else [rng.randrange(tok.vocab_size) for _ in range(40)]
        got, state = "", (0, 0)
        for n in range(1, len(ids) + 1):
            added, state = decode_delta(tok, ids[:n], state)
            got += added
            assert tok.decode(ids[:n]).startswith(got)
        got += decode_delta(tok, ids, state, final=True)[0]
        assert got == tok.decode(ids)


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode_token_for_token_on_a_gpu():
    """bf16, mixed batches joining and leaving (staggered prompt and output lengths, more
    requests than rows): the server's captured decode steps, fed on the device, give the
    tokens of the eager paged forward fed from the host."""
    engine = moe_infer.load("tiny-moe", device="cuda", dtype="bfloat16", progress=False)
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 60))] for _ in range(20)]
    lengths = [rng.randrange(4, 40) for _ in prompts]

    def run(graph: bool):
        scheduler = Scheduler(engine, num_blocks=8 * 16, block_size=8, max_batch=8)
        scheduler.runner.static = graph
        if not graph:
            scheduler.broadcast = lambda rows, mode: None  # host-fed rows, delivered before the next step
        reqs = [Request(p, SamplingParams(), n, lambda *a: None) for p, n in zip(prompts, lengths)]
        _serve_all(scheduler, reqs)
        return [r.generated for r in reqs], len(scheduler.runner._steps)

    (graph, captured), (eager, _) = run(True), run(False)
    assert captured >= 2 and graph == eager


def test_a_step_replayed_from_a_graph_asks_sdpa_for_cudnn_first(engine, monkeypatch):
    """A forward whose context says it is replayed from a CUDA graph (fixed shapes) enters
    SDPA with cuDNN's kernels first, in that priority, unless ``cudnn_prefill_graphs`` is
    off; any other forward with the kernels eager prefills take. The logits do not change."""
    from dataclasses import replace

    import moe_infer.model
    from dense.attention import GRAPH_SDPA_BACKENDS, SDPA_BACKENDS

    seen, real = [], moe_infer.model.sdpa_kernel
    monkeypatch.setattr(moe_infer.model, "sdpa_kernel",
                        lambda backends, set_priority=False: seen.append((backends, set_priority)) or real(
                            backends, set_priority=set_priority))
    model, options = engine.model, engine.model.options
    tokens = torch.tensor([[5, 9, 2, 7, 11]])
    ctx = model.context(torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool), no_padding=True)
    try:
        plain = model(tokens, ctx)
        graphed = model(tokens, replace(ctx, graphed=True))
        model.options = replace(options, cudnn_prefill_graphs=False)
        off = model(tokens, replace(ctx, graphed=True))
    finally:
        model.options = options
    assert seen == [(SDPA_BACKENDS, False), (GRAPH_SDPA_BACKENDS, True), (SDPA_BACKENDS, False)]
    assert torch.equal(plain, graphed) and torch.equal(plain, off)


@pytest.mark.gpu
def test_a_captured_prefill_on_cudnn_attention_equals_the_flash_one_and_the_eager_forward_on_a_gpu():
    """bf16: fresh prompts prefilled through a captured bucket with its attention on cuDNN's
    SDPA kernels (``cudnn_prefill_graphs``, the default) and on flash's give the last
    tokens' logits of the eager forward, to bf16 rounding, and the same greedy tokens."""
    from dataclasses import replace

    engine = moe_infer.load("tiny-moe", device="cuda", dtype="bfloat16", progress=False)
    rng = random.Random(3)
    vocab = engine.config.model.vocab_size
    rows, free = [], list(range(64))
    for n in (7, 30, 19):
        need = -(-n // 8)
        rows.append(Row([rng.randrange(vocab) for _ in range(n)], 0, free[:need]))
        free = free[need:]
    eager = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=8).forward_all(rows)[:, -1].float()
    got = {}
    for cudnn in (True, False):
        engine.model.options = replace(engine.model.options, cudnn_prefill_graphs=cudnn)
        runner = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=8)
        runner.static = True
        logits, ids = runner.decode(rows)
        assert runner._prefills and all(step.graph is not None for step in runner._prefills.values())
        got[cudnn] = logits.float(), ids.tolist()
    for logits, ids in got.values():
        torch.testing.assert_close(logits, eager, rtol=3e-2, atol=3e-2)
    assert got[True][1] == got[False][1]


def test_every_decode_bucket_is_made_before_serving(engine):
    runner = PagedRunner(engine, num_blocks=64, block_size=8, max_batch=6)
    runner.static = True
    runner.capture_all()
    batches = {1, 2, 4, 8}  # 6 rows run in the 8-row bucket
    keys = {64, 128, 256, 512, runner.max_keys} - {k for k in (64, 128, 256, 512) if k > runner.max_keys}
    assert set(runner._steps) == {(b, k) for b in batches for k in keys}
    made = dict(runner._steps)
    for b in range(1, 7):  # serving makes none of its own
        for k in (1, 63, 65, 300, runner.max_keys):
            assert runner.step_for(b, k) is made[(1 << (b - 1).bit_length(), runner.step_for(b, k).keys)]
    assert runner._steps == made


@pytest.mark.parametrize("fresh", [True, False])
def test_an_eager_forwards_inputs_are_each_rows_tokens_padded(fresh):
    """eager_inputs builds by tensor ops what the rows say: fresh rows right-padded with
    positions 0..t-1, others left-padded with their own positions (0 under padding); every
    real token writes the slot its block table gives its position, padding the trash slot."""
    from moe_infer.runner import eager_inputs

    rng, bs, trash = random.Random(3 + fresh), 4, 999
    rows = []
    for _ in range(5):
        start = 0 if fresh else rng.randrange(0, 9)
        n = rng.randrange(1, 11)
        table = rng.sample(range(200), -(-(start + n) // bs) + rng.randrange(0, 3))  # spare blocks beyond
        rows.append(Row([rng.randrange(1000) for _ in range(n)], start, table))
    t = max(len(r.tokens) for r in rows)
    tokens, positions, valid, write, tables = eager_inputs(rows, t, fresh, bs, trash)
    width = -(-max(r.start + len(r.tokens) for r in rows) // bs)
    for i, r in enumerate(rows):
        n, pad = len(r.tokens), t - len(r.tokens)
        slots = [r.table[p // bs] * bs + p % bs for p in range(r.start, r.start + n)]
        if fresh:
            want = (r.tokens + [0] * pad, list(range(t)), [True] * n + [False] * pad, slots + [trash] * pad)
        else:
            want = ([0] * pad + r.tokens, [0] * pad + list(range(r.start, r.start + n)), [False] * pad + [True] * n,
                    [trash] * pad + slots)
        assert (tokens[i].tolist(), positions[i].tolist(), valid[i].tolist(), write[i].tolist()) == want
        held = r.table[:width]
        assert tables[i].tolist() == held + [0] * (width - len(held))
