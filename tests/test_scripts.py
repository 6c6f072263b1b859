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

ROOT = Path(__file__).resolve().parent.parent
SMOKES = {
    "bench_moe": (["--smoke", "--no-json"], "routing-graph"),
    "bench_dense": (["--device", "cpu", "--smoke"], "SDPA masked"),
    "bench_decode": (["--device", "cpu", "--smoke"], "floor MB"),
    "bench_serve": (["--smoke"], "TTFT p50"),
}


@pytest.mark.parametrize("script", list(SMOKES))
def test_benchmark_smoke_run(script):
    args, header = SMOKES[script]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args], cwd=ROOT, env=env,
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
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("batch"))
    rows = [line.split() for line in lines[header + 2:header + 4]]
    assert [r[0] for r in rows] == ["1", "3"], out.stdout[-2000:]
    for r in rows:  # numbers, not "-" (their sign is noise at smoke sizes on a busy CPU)
        assert r[-2] != "-" and r[-1] != "-", out.stdout[-2000:]
        float(r[-2]), float(r[-1])


def test_bench_decode_table_of_prompt_lengths_and_batches():
    """--prompt-lens: one row per (prompt length, batch) cell with prefill and decode figures,
    and the peer's columns filled for the cells --peer-cells names, "-" elsewhere."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_decode.py"), "--device", "cpu", "--smoke",
                          "--prompt-lens", "4,20", "--peer", "--peer-cells", "20:3"], cwd=ROOT, env=env,
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
    "diag_ep": (["--hidden", "64", "--tokens", "8", "--reps", "2"], "whole combine"),
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


def test_dense_table_writer_keeps_pinned_entries(tmp_path, monkeypatch):
    """bench_dense --write-table replaces an entry with this run's winner unless the entry
    carries a "pinned" reason (chosen by timing the decode step itself)."""
    import torch

    from kernels import linear_select as sel
    bench_dense = _script("bench_dense")
    pinned = {"backend": "cuda", "bn": 4, "warps": 8, "unroll": 2, "split_k": 1, "pinned": "decode step A/B"}
    table = {"cpu": {"N64:K32:bfloat16": {"1": pinned, "2": "cublas"}, "N64:K32:int8": {"1": "triton"}}}
    path = tmp_path / "dense.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(sel, "TABLE_FILE", path)
    cfg = {"bn": 2, "warps": 4, "unroll": 1, "split_k": 1}
    rows = [dict(T=t, N=64, K=32, cublas_us=9.0, ours_us=8.0, sbi_us=7.0, cuda_us=3.0, ours_int8_us=6.0,
                 sbi_int8_us=2.0, cuda_int8_us=4.0, cuda_cfg=cfg, cuda_int8_cfg=cfg) for t in (1, 2)]
    bench_dense.write_table(torch.device("cpu"), torch.bfloat16, rows)
    written = json.loads(path.read_text())["cpu"]
    assert written["N64:K32:bfloat16"]["1"] == pinned
    assert written["N64:K32:bfloat16"]["2"] == dict(cfg, backend="cuda")
    assert written["N64:K32:int8"] == {"1": "sbi", "2": "sbi"}


def test_diag_decode_ab_table_entries(monkeypatch):
    """--dense-entry / --moe-entry replace one entry of a table in the process, and --alternate
    puts back what they replaced; a malformed one is refused with the expected form named."""
    from kernels import linear_select as sel
    from kernels import moe_triton
    diag = _script("diag_decode_ab")
    dense, moe = {"cpu": {"N64:K32:bfloat16": {"2": "sbi"}}}, {}
    monkeypatch.setattr(sel, "_table", lambda: dense)
    monkeypatch.setattr(moe_triton, "_tuned", lambda: moe)
    cfg = {"backend": "cuda", "bn": 2, "warps": 4, "unroll": 1, "split_k": 1}
    edits = [diag.table_entry("dense", f"N64:K32:bfloat16/1={json.dumps(cfg)}"),
             diag.table_entry("dense", 'N64:K32:bfloat16/2="cublas"'),
             diag.table_entry("moe", 'up:E8:N64:K32:bfloat16:k2/1={"backend": "cuda", "bn": 8}')]
    saved = {}
    diag.set_entries(edits, True, saved)
    assert dense["cpu"]["N64:K32:bfloat16"] == {"1": cfg, "2": "cublas"}
    assert moe["cpu"]["up:E8:N64:K32:bfloat16:k2"] == {"1": {"backend": "cuda", "bn": 8}}
    diag.set_entries(edits, False, saved)
    assert dense["cpu"]["N64:K32:bfloat16"] == {"2": "sbi"} and moe["cpu"]["up:E8:N64:K32:bfloat16:k2"] == {}
    for kind, bad, says in (("dense", "N64:K32:bfloat16/3=\"sbi\"", "BUCKET one of"),
                            ("dense", "N64:K32:bfloat16/1={bn", "not JSON"),
                            ("dense", "N64:K32:bfloat16/1", "KEY/BUCKET"),
                            ("moe", "up:E8:N64:K32:bfloat16:k2/17={}", "BUCKET one of")):
        with pytest.raises(SystemExit, match=says):
            diag.table_entry(kind, bad)


def test_tune_moe_large_t_candidates_try_short_last_tiles():
    """At large T the tuner also times 128-row tiles with sub_m 2, and every candidate is
    one grouped_gemm accepts (bm / sub_m >= 16)."""
    tune_moe = _script("tune_moe")
    cands = tune_moe.triton_candidates("up", 4096, 8, 64, "bf16")
    subs = [c for c in cands if c.get("sub_m")]
    assert subs and all(c["bm"] == 128 and c["sub_m"] == 2 for c in subs)
    assert len(cands) == len({json.dumps(c, sort_keys=True) for c in cands})  # no duplicates
    assert {json.dumps({k: v for k, v in c.items() if k != "sub_m"}, sort_keys=True) for c in subs} <= \
        {json.dumps(c, sort_keys=True) for c in cands if not c.get("sub_m")}


def test_tune_moe_keeps_pinned_and_untuned_buckets(capsys):
    """The tuner's merge replaces the buckets it timed, keeps the others, and keeps an entry
    pinned by a decode-step A/B whatever this run picked (saying so)."""
    tune_moe = _script("tune_moe")
    pinned = {"backend": "cuda", "bn": 8, "pinned": "decode step A/B"}
    table = {"1": pinned, "2": "old", "16": "untouched"}
    tune_moe.merge(table, "down:E8:N64:K32:int8:k2", {"1": {"backend": "cuda", "bn": 4}, "2": "new"})
    assert table == {"1": pinned, "2": "new", "16": "untouched"}
    assert "kept down:E8:N64:K32:int8:k2 T 1 (decode step A/B)" in capsys.readouterr().out


def test_diag_decode_ab_switches_a_built_model():
    """--alternate sets each switch on the built model's modules (every instance of a class,
    or the module) and restores it; switches read only at construction are not offered."""
    import importlib

    import moe_infer
    from moe_infer import moe_layer

    qkv_attention = importlib.import_module("kernels.qkv_attention")  # the module, not the package's function

    diag = _script("diag_decode_ab")
    net = moe_infer.load("tiny-moe", device="cpu", progress=False).model
    layers = [m for m in net.modules() if isinstance(m, moe_layer.MoELayer)]
    assert layers and not any(m.route_in_experts for m in layers)
    assert diag.set_switches(net, ["route-in", "preload-kv"], True) == {"route-in": True, "preload-kv": False}
    assert all(m.route_in_experts for m in layers) and qkv_attention.PRELOAD_KV is False
    diag.set_switches(net, ["route-in", "preload-kv"], False)
    assert not any(m.route_in_experts for m in layers) and qkv_attention.PRELOAD_KV is True
    assert "moe-cuda" not in diag.SWITCHES and set(diag.SWITCHES) <= set(diag.OFF + diag.ON)


def test_diag_decode_ab_variants_file(tmp_path, monkeypatch):
    """--variants reads named variants (table entries and switches) from a JSON file, in its
    order, and refuses a malformed one with the variant and what was expected named."""
    from kernels import linear_select as sel
    from kernels import moe_triton
    diag = _script("diag_decode_ab")
    dense, moe = {"cpu": {}}, {}
    monkeypatch.setattr(sel, "_table", lambda: dense)
    monkeypatch.setattr(moe_triton, "_tuned", lambda: moe)
    cfg = {"backend": "cuda", "bn": 2, "warps": 4, "unroll": 1, "split_k": 1}
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"o bn 2": {"dense": {"N64:K32:bfloat16/1": cfg}},
                                "route in": {"switch": ["route-in"],
                                             "moe": {"up:E8:N64:K32:bfloat16:k2/1": {"bn": 8}}}}))
    variants = diag.load_variants(str(path))
    assert [(name, parts, len(edits)) for name, parts, edits in variants] == [("o bn 2", [], 1),
                                                                            ("route in", ["route-in"], 1)]
    (entries, bucket, entry), = variants[0][2]
    assert bucket == "1" and entry == cfg and entries is dense["cpu"]["N64:K32:bfloat16"]
    for bad, says in (({"base": {}}, "other than 'base'"), ({"x": {"dense": {}, "bogus": 1}}, "expected keys"),
                      ({"x": {"switch": ["nope"]}}, "switches are"), ([], "JSON object"),
                      ({"x": {"dense": {"N64:K32:bfloat16/3": "sbi"}}}, "BUCKET one of")):
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=says):
            diag.load_variants(str(path))


def test_diag_moe_ab_variants_file(tmp_path):
    """diag_moe_ab.py reads {shape: {dtype: {name: {up/down}}}} and refuses anything else
    with the shape, dtype or variant named."""
    diag = _script("diag_moe_ab")
    path = tmp_path / "v.json"
    good = {"dsmoe": {"int8": {"up bn 8": {"up": {"backend": "cuda", "bn": 8, "warps": 4, "unroll": 1}}},
                      "bf16": {}}}
    path.write_text(json.dumps(good))
    assert diag.load_variants(str(path)) == good
    for bad, says in (({"gpt": {}}, "expected one of"), ({"dsmoe": {"fp8": {}}}, "bf16|int8"),
                      ({"dsmoe": {"int8": {"x": {"up": {}, "gate": {}}}}}, "'up' and/or 'down'"),
                      ({"dsmoe": {"int8": {"table": {"up": {}}}}}, "other than 'table'"), ([], "object of shapes")):
        path.write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=says):
            diag.load_variants(str(path))
    # A variant's configuration: the table's where absent, the table's changed with "from_table".
    table = {"backend": "cuda", "bn": 4, "warps": 4, "unroll": 1, "pipe": True}
    assert diag.merged(None, table) is table
    assert diag.merged({"from_table": True, "warps": 8, "row_groups": 2}, table) == dict(table, warps=8, row_groups=2)
    assert diag.merged({"backend": "cuda", "bn": 8}, table) == {"backend": "cuda", "bn": 8}


def test_diag_hop_kernel_compiles_and_chain_value():
    """diag_hop.py's kernel compiles for sm_90 in each hand-off mode and weight unroll (NVRTC
    with ptxas, no GPU), and the value its check expects follows the kernels' recurrence."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the test extras install cupy and NVRTC")
    from kernels import cuda_common

    hop = _script("diag_hop")
    for mode in hop.MODES.values():
        for unroll in (0, 1, 4):
            cuda_common.compile_check(hop.SOURCE, ("-std=c++17", f"-DMODE={mode}", f"-DUNROLL={unroll}"))
    assert hop.chain_value(2.0, 0) == 2.0 and hop.chain_value(2.0, 1) == 2.0 and hop.chain_value(0.0, 2) == 1.5


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
    from kernels.moe_triton import default_config

    for phase, n, k in (("up", 2048, 2048), ("down", 2048, 1024)):
        found = tune_moe.candidates(phase, 256, 8, 64, "int8", tune_moe.SHAPES["olmoe"], sms=132)
        assert default_config(phase, 256, 64, n, k, 8, 132) in found
    assert tune_moe.candidates("up", 256, 8, 64, "int8", tune_moe.SHAPES["olmoe"],
                               stored={"bm": 16}) == [{"bm": 16}, tune_moe.DEQUANT]


def test_tune_moe_offers_the_dequantizing_path_for_int8_at_large_t():
    """Past the CUDA decode kernels' T, int8 also tries the experts widened to bf16 first; a
    down GEMM behind it is part of that path; bf16 and small T never get it."""
    tune_moe = _script("tune_moe")
    olmoe = tune_moe.SHAPES["olmoe"]
    assert tune_moe.DEQUANT in tune_moe.candidates("up", 1024, 8, 64, "int8", olmoe)
    assert tune_moe.DEQUANT in tune_moe.candidates("up", 1024, 8, 64, "int8", olmoe, stored={"bm": 64})
    assert tune_moe.candidates("down", 1024, 8, 64, "int8", olmoe, up_backend="dequant") == [tune_moe.DEQUANT]
    assert tune_moe.DEQUANT not in tune_moe.candidates("up", 1024, 8, 64, "bf16", olmoe)
    assert tune_moe.DEQUANT not in tune_moe.candidates("up", 16, 8, 64, "int8", olmoe)
