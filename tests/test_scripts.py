"""The benchmark scripts run end to end in their smoke modes (tiny shapes on the CPU), so a
GPU session's scarce device time is not lost to a script that no longer starts. Their
numbers here mean nothing; only that each prints its table and exits 0."""
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moe_infer

ROOT = Path(__file__).resolve().parent.parent
SMOKES = {
    "bench_moe": (["--smoke", "--no-json"], "routing-graph"),
    "bench_dense": (["--device", "cpu", "--smoke"], "SDPA gathered"),
    # (bench_decode: the two tests of its --peer tables below run it)
    "bench_serve": (["--smoke"], "TTFT p50"),
    "bench_offload": (["--smoke"], "cold experts/step"),
    "validate_costmodel": ([], "first choice fastest or within 5%"),  # bench/results against the cost model
    "extrapolate": (["--no-plot"], "published under"),
    "extrapolate palm": (["--no-plot", "--paper", "palm"], "published MFU"),  # (the script: the first word)
}


@pytest.mark.parametrize("script", list(SMOKES))
def test_benchmark_smoke_run(script):
    args, header = SMOKES[script]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script.split()[0]}.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert header in out.stdout, out.stdout[-2000:]


def test_bench_decode_peer_after_our_model_is_freed():
    """--peer times transformers after our weights are released (a second copy of a large
    model does not fit beside them): the peer columns hold numbers for every batch."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode.py"), "--device", "cpu", "--smoke",
                          "--peer"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "floor MB" in out.stdout, out.stdout[-2000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("batch"))
    rows = [line.split() for line in lines[header + 2:header + 4]]
    assert [r[0] for r in rows] == ["1", "3"], out.stdout[-2000:]
    for r in rows:  # numbers, not "-" (their sign is noise at smoke sizes on a busy CPU)
        assert r[-2] != "-" and r[-1] != "-", out.stdout[-2000:]
        float(r[-2]), float(r[-1])


def test_bench_decode_table_of_prompt_lengths_and_batches():
    """--prompt-lens: one row per (prompt length, batch) cell with prefill and decode figures,
    and the peer's columns filled for the cells --peer-cells names, "-" elsewhere (with
    --routing, each cell's routing counted too)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode.py"), "--device", "cpu", "--smoke",
                          "--prompt-lens", "4,20", "--peer", "--peer-cells", "20:3", "--routing"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("prompt  batch"))
    assert "decode ms/token" in lines[header] and "peer / ours" in lines[header]
    rows = [line.split() for line in lines[header + 2:header + 6]]
    assert [r[:2] for r in rows] == [["4", "1"], ["4", "3"], ["20", "1"], ["20", "3"]], out.stdout[-2000:]
    for r in rows:
        assert float(r[2]) > 0 and float(r[6]) > 0  # prefill ms, decode ms/token
        assert (r[-3] != "-") == (r[:2] == ["20", "3"]), out.stdout[-2000:]


MULTI_RANK = {  # run under scripts/launch.sh with 2 ranks (gloo)
    "bench_ep": (["--device", "cpu", "--smoke", "--no-json"], "PCC / naive"),
    # (bench_layouts: the scaling smoke below runs it, its baseline and five layouts)
    "bench_pipeline": (["--smoke", "--no-json", "--peers", "tp"], "hybrid (8) / equal"),  # 4 P micro-batches against P
    "bench_serve": (["--smoke", "--pp", "2"], "TTFT p50"),  # rank 0 serves, rank 1 follows its slots
}


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the test extras install mpich)")
@pytest.mark.parametrize("script", list(MULTI_RANK))
def test_multi_rank_script_smoke_run(script):
    """Both ranks finish and the job exits 0: the process group is shut down cleanly (a
    rank leaving while gloo still talks to it used to make mpiexec report a bad exit)."""
    args, header = MULTI_RANK[script]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out = subprocess.run([str(ROOT / "scripts" / "launch.sh"), "-n", "2", "--", sys.executable,
                          str(ROOT / "scripts" / f"{script}.py"), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert header in out.stdout, out.stdout[-2000:]


def _script(name):
    sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[:2]


def test_dense_table_writer_keeps_pinned_entries(tmp_path):
    """bench_dense --write-table replaces an entry of the device's linear tables with this
    run's winner unless the entry is pinned (chosen by timing the decode step itself)."""
    import torch

    from kernels import tuning
    bench_dense = _script("bench_dense")
    pinned = tuning.LinearCuda(bn=4, warps=8, unroll=2, split_k=1, pinned=True)
    tuning.write_table(tmp_path, tuning.Table("linear", "cpu", "bfloat16", {"N64:K32": {1: pinned,
                                                                                        2: tuning.LinearCublas()}}))
    tuning.write_table(tmp_path, tuning.Table("linear", "cpu", "int8", {"N64:K32": {1: tuning.LinearTriton()},
                                                                        "N8:K8": {4: tuning.LinearTriton()}}))
    cfg = {"bn": 2, "warps": 4, "unroll": 1, "split_k": 1}
    rows = [dict(T=t, N=64, K=32, cublas_us=9.0, ours_us=8.0, sbi_us=7.0, cuda_us=3.0, ours_int8_us=6.0,
                 sbi_int8_us=2.0, cuda_int8_us=4.0, cuda_cfg=cfg, cuda_int8_cfg=cfg) for t in (1, 2)]
    bench_dense.write_table(torch.device("cpu"), torch.bfloat16, rows, root=tmp_path)
    bf16 = tuning.load_table(tmp_path / "linear" / "tables" / "cpu-bfloat16.json").entries
    int8 = tuning.load_table(tmp_path / "linear" / "tables" / "cpu-int8.json").entries
    assert bf16 == {"N64:K32": {1: pinned, 2: tuning.LinearCuda(**cfg)}}
    assert int8 == {"N64:K32": {1: tuning.LinearSbi(), 2: tuning.LinearSbi()}, "N8:K8": {4: tuning.LinearTriton()}}


@pytest.mark.parametrize("name,tp", [("olmoe-1b-7b", 2), ("mixtral-8x7b", 2), ("qwen3-30b-a3b", 8), ("tiny-moe", 1)])
def test_dense_shapes_of_a_tensor_parallel_rank_are_the_model_layers(name, tp):
    """bench_dense --tp times the weights one rank of the group holds: the attention layer
    built for that rank (fewer KV heads than ranks included) has those shapes; with an
    all-heads q / k norm (OLMoE) a prompt projects the rank's own rows, a decode step all."""
    import torch

    from comm import Group
    from dense.attention import Attention
    from moe_infer.loader import resolve_config

    bench_dense = _script("bench_dense")
    with torch.device("meta"):
        attn = Attention(resolve_config(name).model, Group(None, 0, tp, tuple(range(tp))))
    shapes = {layer: (k, n) for layer, k, n in bench_dense.linear_shapes(name, tp)}
    assert shapes.get("qkv decode", shapes["qkv"]) == tuple(attn.qkv_proj.weight.shape[::-1])
    assert shapes["qkv"] == (attn.qkv_proj.in_features, attn.own_rows)
    assert ("qkv decode" in shapes) == (name == "olmoe-1b-7b" and tp > 1)
    assert shapes["o"] == tuple(attn.o_proj.weight.shape[::-1])
    assert ("lm head" in shapes) == (tp == 1)


def test_cost_model_choice_counts_a_pick_within_five_percent_of_the_fastest():
    validate = _script("validate_costmodel")
    kw = {"tp2": dict(tp=2), "ep2": dict(dp=2, ep=2), "tp4": dict(tp=4), "ep4": dict(dp=4, ep=4), "one GPU": {}}

    def row(layout, batch, ms, predicted):
        return dict(model="m", device="d", layout=layout, parallel=kw[layout], batch=batch, ms=ms,
                    predicted=predicted)
    rows = [row("one GPU", 1, 1.0, 0.1),  # (never a choice: another world size)
            row("tp2", 1, 2.0, 1.0), row("ep2", 1, 1.0, 1.5),  # picks tp2, twice the fastest
            row("tp2", 8, 1.04, 1.0), row("ep2", 8, 1.0, 1.2),  # picks tp2, within 5%
            row("tp2", 64, 1.0, 1.0),  # one layout of 2 GPUs: no choice to make ...
            row("tp4", 64, 0.5, 0.9)]  # ... nor with the one of 4 (not a rival of 2 GPUs' tp2)
    rows += [row("tp4", 1, 1.0, 0.5), row("ep4", 1, 0.9, 0.6)]  # 4 GPUs: picks tp4, 11% slower
    picks = validate.choices(rows)
    assert [(p["gpus"], p["batch"], p["picked"], p["best"], p["hit"]) for p in picks] == [
        (2, 1, "tp2", "ep2", False), (2, 8, "tp2", "ep2", True), (4, 1, "tp4", "ep4", False)]


def test_cost_model_validation_takes_each_rows_latest_run(tmp_path):
    """A row measured again (the same model, device, layout, batch and context) counts by
    its later run, whichever file sorts first; another context or layout stays a row of
    its own; ``superseded`` keeps every run."""
    import json

    validate = _script("validate_costmodel")

    def results(name, time, rows, prompt_len=128):
        path = tmp_path / name
        path.write_text(json.dumps({"run": {"device": "NVIDIA H200", "time": time}, "model": "olmoe-1b-7b",
                                    "args": {"prompt_len": prompt_len, "new_tokens": 32},
                                    "rows": [dict(layout=lay, parallel=dict(tp=2), batch=1, ms_per_token=ms)
                                             for lay, ms in rows]}))
        return path
    files = [results("a-new.json", "2026-11-28T10:00:00", [("tp2", 0.9)]),
             results("b-old.json", "2026-11-27T10:00:00", [("tp2", 1.2), ("tp2-nccl", 1.0)]),
             results("c-long.json", "2026-11-26T10:00:00", [("tp2", 3.0)], prompt_len=2048)]
    kept = validate.compare(files)
    assert sorted((r["layout"], r["context"], r["ms"]) for r in kept) == [
        ("tp2", 144.0, 0.9), ("tp2", 2064.0, 3.0), ("tp2-nccl", 144.0, 1.0)]
    assert len(validate.compare(files, superseded=True)) == 4


def test_cost_model_validation_reads_the_decode_matrix_and_the_pipeline(tmp_path):
    """The time to the first token of bench_decode's matrix (bf16; int8 runs are left out;
    a run on the first layers is predicted on those layers) and bench_pipeline's prompt
    processing (pp, each micro-batch count) are prefill rows, predicted as prefills; the
    matrix's decode ms a token are one-GPU decode rows at the middle of the generated span."""
    import json

    validate = _script("validate_costmodel")
    run = {"device": "NVIDIA H200", "time": "2026-11-28T10:00:00"}
    cells = [{"prompt_len": 128, "batch": 8, "prefill_s": 0.02, "decode_ms_per_token": 3.5}]
    matrix = tmp_path / "decode-matrix-olmoe.json"
    matrix.write_text(json.dumps({"run": run, "model": "olmoe-1b-7b",
                                  "args": {"quantize": None, "layers": 4, "new_tokens": 32}, "cells": cells}))
    int8 = tmp_path / "decode-matrix-olmoe-int8.json"
    int8.write_text(json.dumps({"run": run, "model": "olmoe-1b-7b", "args": {"quantize": "int8"}, "cells": cells}))
    pipe = tmp_path / "pipeline-olmoe.json"
    pipe.write_text(json.dumps({"run": run, "model": "olmoe-1b-7b",
                                "args": {"prompt_len": 128, "new_tokens": 16, "prompts": 16, "prompt_tokens": 1024},
                                "decode": [{"layout": "pp2", "parallel": {"pp": 2}, "batch": 8, "ms_per_step": 5.0}],
                                "prompts": [{"schedule": "hybrid", "micro_batches": 8, "seconds": 0.5}]}))
    rows = validate.compare([matrix, int8, pipe])
    got = sorted((r.get("phase", "decode"), r["layout"], r["batch"], r["context"], r["ms"]) for r in rows)
    assert got == [("decode", "one GPU", 8, 144.0, 3.5), ("decode", "pp2", 8, 136.0, 5.0),
                   ("prefill", "one GPU", 8, 128, 20.0), ("prefill", "pp2, 8 micro-batches", 16, 1024, 500.0)]
    cost = validate.CostModel(validate.bc.first_layers(validate.resolve_config("olmoe-1b-7b"), 4),
                              validate.Hardware.load("nvidia-h200"))
    want = cost.predict(validate.ParallelConfig(), "prefill", 8, 128, prompt=128).ms
    assert next(r for r in rows if r.get("phase") == "prefill" and r["layout"] == "one GPU")["predicted"] == \
        pytest.approx(want)
    want = cost.predict(validate.ParallelConfig(), "decode", 8, 144).ms
    assert next(r for r in rows if r.get("phase") is None and r["layout"] == "one GPU")["predicted"] == \
        pytest.approx(want)
    # graphed prefills ran flash's attention before the run recorded its kernel options
    assert [r["cudnn_prefill_graphs"] for r in rows if r.get("phase") == "prefill"] == [False, False]
    later = tmp_path / "decode-matrix-olmoe-later.json"
    later.write_text(json.dumps({"run": run, "model": "olmoe-1b-7b", "kernel_options": {"cudnn_prefill_graphs": True},
                                 "args": {"quantize": None, "layers": 4, "new_tokens": 32}, "cells": cells}))
    assert [r.get("cudnn_prefill_graphs") for r in validate.rows_of(later)] == [True, None]


def test_cost_model_validation_prices_a_prefill_by_the_routing_its_run_recorded(tmp_path):
    """A matrix cell recorded with --routing (each MoE layer's picks per expert over its
    prompts) is predicted with that routing at prefill; its decode row, whose tokens the
    prompts' routing did not see, stays uniform."""
    import json

    validate = _script("validate_costmodel")
    cfg = validate.bc.first_layers(validate.resolve_config("olmoe-1b-7b"), 2)
    routing = {str(i): [100] * 8 + [0] * 56 for i in range(2) if cfg.is_moe_layer(i)}
    cells = [{"prompt_len": 128, "batch": 1, "prefill_s": 0.004, "decode_ms_per_token": 0.5, "routing": routing}]
    matrix = tmp_path / "decode-matrix-olmoe.json"
    matrix.write_text(json.dumps({"run": {"device": "NVIDIA H200", "time": "2026-11-29T10:00:00"},
                                  "model": "olmoe-1b-7b", "args": {"quantize": None, "layers": 2, "new_tokens": 32},
                                  "cells": cells}))
    rows = validate.compare([matrix])
    hw = validate.Hardware.load("nvidia-h200")
    measured = validate.CostModel(cfg, hw, histogram={int(k): v for k, v in routing.items()})
    prefill = next(r for r in rows if r.get("phase") == "prefill")["predicted"]
    assert prefill == pytest.approx(measured.predict(validate.ParallelConfig(), "prefill", 1, 128, prompt=128).ms)
    assert prefill < validate.CostModel(cfg, hw).predict(validate.ParallelConfig(), "prefill", 1, 128, prompt=128).ms
    decode = next(r for r in rows if r.get("phase") is None)["predicted"]
    assert decode == pytest.approx(validate.CostModel(cfg, hw).predict(validate.ParallelConfig(), "decode", 1, 144).ms)


def test_tune_moe_large_t_candidates_try_short_last_tiles():
    """At large T the tuner also times 128-row tiles with sub_m 2, and every candidate is
    one grouped_gemm accepts (bm / sub_m >= 16)."""
    tune_moe = _script("tune_moe")
    from dataclasses import replace

    cands = tune_moe.triton_candidates("up", 4096, 8, 64, "bf16")
    subs = [c for c in cands if c.sub_m > 1]
    assert subs and all(c.bm == 128 and c.sub_m == 2 for c in subs)
    assert len(cands) == len(set(cands))  # no duplicates
    assert {replace(c, sub_m=1) for c in subs} <= {c for c in cands if c.sub_m == 1}


def test_tune_moe_tunes_the_share_of_a_shape_a_rank_runs():
    """--ep / --slices: the experts one rank holds under expert parallelism (E / ep) or
    expert-slicing (F / slices), keyed as the kernels look them up; a share that does not
    divide the shape is refused before any tuning, naming both."""
    tune_moe = _script("tune_moe")
    from kernels import tuning

    assert tune_moe.rank_shape("qwen3", ep=2) == (2048, 768, 64, 8, "silu")
    h, f, e, k, _ = tune_moe.rank_shape("qwen3", slices=2)
    assert tuning.moe_shape("down", e, h, f, k) == "down:E128:N2048:K384:k8"
    with pytest.raises(SystemExit, match=r"--ep 3 / --slices 1: qwen3 has E = 128 experts of F = 768"):
        tune_moe.rank_shape("qwen3", ep=3)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tune_moe.py"), "--ep", "0"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--ep '0' / --slices '1': expected comma-separated whole numbers >= 1" in out.stderr


def test_tune_moe_keeps_pinned_and_untuned_buckets(capsys):
    """The tuner's merge replaces the buckets it timed, keeps the others, and keeps an entry
    pinned by a decode-step A/B whatever this run picked (saying so)."""
    tune_moe = _script("tune_moe")
    from kernels.tuning import MoeCuda

    pinned, old, untouched, new = (MoeCuda(bn=8, warps=4, unroll=1, pinned=True), MoeCuda(bn=2, warps=4, unroll=1),
                                   MoeCuda(bn=16, warps=4, unroll=1), MoeCuda(bn=4, warps=4, unroll=2))
    table = {1: pinned, 2: old, 16: untouched}
    tune_moe.merge(table, "down:E8:N64:K32:k2", {1: MoeCuda(bn=4, warps=4, unroll=1), 2: new})
    assert table == {1: pinned, 2: new, 16: untouched}
    assert "kept down:E8:N64:K32:k2 T 1 (pinned)" in capsys.readouterr().out


def test_bench_moe_checks_at_each_check_token_count(capsys):
    """--check-tokens checks ours against the float32 reference at each T given (the large-T
    table entries run other kernels than T = 16), and a T below 1 is refused by name."""
    import torch

    bench_moe = _script("bench_moe")
    shape, device = bench_moe.SMOKE_SHAPES["tiny-silu"], torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    weights, _ = bench_moe.prepare_weights(shape, ["bf16", "int8"], device, gen)
    rows = bench_moe.check_shape(shape, weights, [], device, gen, [3, 33])
    assert [(r["T"], r["what"]) for r in rows] == [(3, "ours bf16"), (3, "ours int8"), (33, "ours bf16"),
                                                  (33, "ours int8")]
    assert all(r["rel_norm_err"] < 2e-2 for r in rows), rows
    with pytest.raises(SystemExit):
        bench_moe.parse_args(["--device", "cpu", "--check-tokens", "16,0"])
    assert "--check-tokens" in capsys.readouterr().err


def test_tune_moe_times_the_heuristic_beside_its_search_space():
    """The configuration that runs where the table has no entry is a candidate too, so a
    tuned entry cannot be slower than having none."""
    tune_moe = _script("tune_moe")
    from kernels.moe.triton import default_config

    for phase, n, k in (("up", 2048, 2048), ("down", 2048, 1024)):
        found = tune_moe.candidates(phase, 256, 8, 64, "int8", tune_moe.SHAPES["olmoe"], sms=132)
        assert default_config(phase, 256, 64, n, k, 8, 132) in found
    from kernels.tuning import MoeTriton

    stored = MoeTriton(bm=16, bn=64, bk=128, num_warps=4, num_stages=3, split_k=1)
    assert tune_moe.candidates("up", 256, 8, 64, "int8", tune_moe.SHAPES["olmoe"], stored=stored,
                               sms=132) == [stored, tune_moe.DEQUANT]


def test_tune_moe_offers_the_dequantizing_path_for_int8_at_large_t():
    """Past the CUDA decode kernels' T, int8 also tries the experts widened to bf16 first; a
    down GEMM behind it is part of that path; bf16 and small T never get it."""
    tune_moe = _script("tune_moe")
    olmoe = tune_moe.SHAPES["olmoe"]
    from kernels.tuning import MoeTriton

    stored = MoeTriton(bm=64, bn=64, bk=64, num_warps=8, num_stages=3, split_k=1)
    assert tune_moe.DEQUANT in tune_moe.candidates("up", 1024, 8, 64, "int8", olmoe, sms=132)
    assert tune_moe.DEQUANT in tune_moe.candidates("up", 1024, 8, 64, "int8", olmoe, stored=stored, sms=132)
    assert tune_moe.candidates("down", 1024, 8, 64, "int8", olmoe, up_backend="dequant", sms=132) == \
        [tune_moe.DEQUANT]
    assert tune_moe.DEQUANT not in tune_moe.candidates("up", 1024, 8, 64, "bf16", olmoe, sms=132)
    assert tune_moe.DEQUANT not in tune_moe.candidates("up", 16, 8, 64, "int8", olmoe, sms=132)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the test extras install mpich)")
def test_scaling_runs_every_world_size_and_predicts_each_row(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    # (the layouts' own runs are the mpi tests'; here three, one of each kind of exchange)
    three = ["tp2", "ep2-dp-attention", "pp2"]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "scaling.py"), "--smoke", "--no-plot",
                          "--layouts", ",".join(three), "--results-dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(next(tmp_path.glob("scaling-tiny-moe-*.json")).read_text())
    assert data["worlds"] == [1, 2]
    layouts = {r["layout"] for r in data["rows"]}
    assert "one GPU" in layouts and set(three) <= layouts
    two_ranks = json.loads(next(tmp_path.glob("layouts-tiny-moe-2ranks-*.json")).read_text())
    assert all(r["collectives_per_token"] > 0 for r in two_ranks["rows"] if r["layout"] != "pp2")
    assert all(r["expert_ms"] == 0 for r in two_ranks["rows"])  # (a CPU: no GPU kernels to count)
    assert all(r["predicted"] > 0 for r in data["rows"])



def test_bench_layouts_counts_the_expert_gemms_on_the_gpu_only():
    """The experts' GEMMs column: kernels.fused_moe's CUDA and Triton kernels and torch's
    grouped GEMM on the GPU; neither the routing kernels nor a CPU op of the same name."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench_layouts = _script("bench_layouts")
    gpu = [SimpleNamespace(device_type=DeviceType.CUDA, name=n) for n in
           ("moe_up", "moe_down", "_grouped_gemm_kernel", "_topk_gating_kernel", "ncclDevKernel_AllReduce")]
    assert [bench_layouts.is_expert_kernel(e) for e in gpu] == [True, True, True, False, False]
    assert not bench_layouts.is_expert_kernel(SimpleNamespace(device_type=DeviceType.CPU, name="moe_up"))


def test_bench_layouts_credits_each_kernel_with_what_it_adds_to_the_timeline():
    """Kernels launched early wait inside their span for the one before: each is credited
    from the later of its start and the latest end before it; a kernel inside another's
    span adds nothing, and a gap before a kernel is nobody's. The experts' column sums
    those shares; CPU events take no part."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench_layouts = _script("bench_layouts")

    def kernel(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(device_type=device, name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [kernel("moe_up", 5.0, 20.0), kernel("_rms_norm_kernel", 0.0, 10.0), kernel("moe_down", 26.0, 28.0),
              kernel("_gather_kernel", 25.0, 30.0), kernel("moe_up", 0.0, 99.0, DeviceType.CPU)]
    shares = bench_layouts.device_shares(events)
    assert [shares[id(e)] for e in events[:4]] == [10.0, 10.0, 0.0, 5.0] and id(events[4]) not in shares
    assert bench_layouts.expert_s(events) == pytest.approx(10e-6)


def test_first_layers_keeps_the_layer_shapes_and_the_per_layer_lists_that_still_apply():
    """bench_decode --layers: a model of the real layer shapes, cut to fit one GPU; the engine
    loads from the Config object itself."""
    bc = _script("bench_common")
    from moe_infer.loader import resolve_config

    cut = bc.first_layers(resolve_config("gpt-oss-20b"), 5)
    whole = resolve_config("gpt-oss-20b")
    assert cut.model.num_layers == 5 and cut.model.sliding_layers == tuple(i for i in whole.model.sliding_layers if i < 5)
    assert cut.model.hidden_size == whole.model.hidden_size and cut.moe == whole.moe
    engine = moe_infer.load(bc.first_layers(resolve_config("tiny-moe"), 1), device="cpu", progress=False)
    assert engine.config.model.num_layers == 1 and len(engine.model.layers) == 1
    with pytest.raises(SystemExit, match="--layers 0"):
        bc.first_layers(whole, 0)
