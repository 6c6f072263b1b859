"""The command line as a new user meets it: serve takes generate's model options, presets
show sizes, generate reports its timings, several ranks print once, and a model too large
for the machine fails before anything is allocated."""
import dataclasses
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import moe_infer
from moe_infer import cli, memory
from moe_infer.config import ConfigError
from moe_infer.config_files import DEFAULT_MODEL, load_preset
from moe_infer.experts import Int8Experts
from ports import free_port

PROMPTS = ["Shall I compare thee", "Let me not to the marriage", "When in disgrace"]


# ----------------------------------------------------------------- serve's model options

@pytest.fixture
def served(monkeypatch):
    """Runs ``moe-infer serve ...`` up to the point it would start HTTP; -> (spec, engine)."""
    pytest.importorskip("fastapi")
    import moe_infer.server as server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda spec, engine: seen.update(spec=spec, engine=engine))

    def run(*argv):
        assert cli.main(["serve", *argv]) == 0
        return seen["spec"], seen["engine"]
    return run


def test_serve_takes_a_preset_as_config_or_model(served):
    for flag in ("--config", "--model"):
        spec, engine = served(flag, "tiny-moe", "--port", "8001")
        assert engine.config.name == "tiny-moe" and spec.server.port == 8001


def test_serve_takes_checkpoint_dtype_quantize_and_layout(served):
    spec, engine = served("--checkpoint", str(DEFAULT_MODEL), "--dtype", "float32", "--quantize", "int8",
                          "--device", "cpu", "--model-name", "sonnets")
    assert engine.config.checkpoint == str(DEFAULT_MODEL) and engine.tokenizer is not None
    assert engine.dtype == torch.float32 and spec.server.model_name == "sonnets"
    assert any(isinstance(m, Int8Experts) for m in engine.model.modules())
    spec, engine = served("--model", "tiny-moe", "--tp", "1", "--no-pcc")
    assert engine.config.parallel.pcc is False and spec.parallel["tp"] == 1


def test_serve_and_generate_take_kv_offload(served, monkeypatch, capsys):
    spec, engine = served("--model", "tiny-moe", "--device", "cpu", "--kv-offload")
    assert engine.config.engine.kv_offload == "all" and spec.engine["kv_offload"] == "all"
    spec, engine = served("--model", "tiny-moe", "--device", "cpu", "--kv-offload", "alternate")
    assert engine.config.engine.kv_offload == "alternate"
    spec, engine = served("--model", "tiny-moe", "--device", "cpu")
    assert engine.config.engine.kv_offload is None
    import moe_infer.loader as loader

    loaded = []
    real = loader.load
    monkeypatch.setattr(loader, "load", lambda *a, **kw: loaded.append(real(*a, **kw)) or loaded[-1])
    assert cli.main(["generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3", "--kv-offload", "--quiet"]) == 0
    assert loaded[0].config.engine.kv_offload and type(loaded[0].runner.cache).__name__ == "OffloadedKVCache"


def test_serve_flags_override_a_serve_yaml(served, tmp_path):
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text("model: default\nengine: {max_batch_size: 4}\nserver: {port: 9000}\n")
    spec, engine = served("--config", str(yaml_file), "--model", "tiny-moe", "--port", "9001")
    assert engine.config.name == "tiny-moe" and engine.config.engine.max_batch_size == 4
    assert spec.server.port == 9001


def test_serve_takes_a_model_yaml(served, tmp_path):
    from moe_infer.config_files import configs_dir

    model_yaml = tmp_path / "m.yaml"
    model_yaml.write_text((configs_dir() / "tiny-moe.yaml").read_text().replace("num_layers: 4", "num_layers: 1"))
    spec, engine = served("--config", str(model_yaml))
    assert engine.config.model.num_layers == 1


def test_serve_bad_sections_fail_naming_the_key(tmp_path, capsys):
    pytest.importorskip("fastapi")
    bad = tmp_path / "serve.yaml"
    bad.write_text("model: tiny-moe\nengine: {max_batch: 4}\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "engine.max_batch=4: unknown key (did you mean 'max_batch_size'?)" in capsys.readouterr().err
    bad.write_text("model: tiny-moe\nparallel: {tp: two}\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "parallel.tp='two': expected an integer" in capsys.readouterr().err


def test_serve_from_the_command_line_answers(tmp_path):
    pytest.importorskip("uvicorn")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moe_infer", "serve", "--config", "tiny-moe", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3,
                                                                               "temperature": 0})
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "no start"
                time.sleep(0.3)
        assert r.status_code == 200 and r.json()["model"] == "tiny-moe"
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ----------------------------------------------------------------- presets and timings

def test_presets_list_total_and_active_parameters_and_size(capsys):
    assert cli.main(["presets"]) == 0
    out = capsys.readouterr().out
    # Mixtral-8x7B's published sizes: 46.7B parameters, 12.9B active per token.
    assert re.search(r"^mixtral-8x7b\s+46\.7B\s+12\.9B\s+93\.4 GB$", out, re.M), out
    # Qwen3-30B-A3B: 30.5B published; 3.35B active here (published as 3.3B), embeddings counted.
    assert re.search(r"^qwen3-30b-a3b\s+30\.5B\s+3\.4B\s+61\.1 GB$", out, re.M), out
    assert re.search(r"^gpt-13b\s+12\.9B\s+12\.9B\s+25\.7 GB$", out, re.M), out  # dense: all active


def test_model_size_counts_what_the_engine_holds():
    engine = moe_infer.load("tiny-moe", progress=False)
    size = memory.model_size(engine.config)
    assert size.total == sum(p.numel() for p in engine.model.parameters())
    moe = engine.config.moe
    routed = sum(p.numel() for n, p in engine.model.named_parameters() if ".experts." in n)
    assert size.active == size.total - routed + routed * moe.top_k // moe.num_experts


def test_generate_prints_one_timing_line_unless_quiet(capsys):
    argv = ["generate", "--model", "tiny-moe", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "5"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"moe-infer: prompt 5 tokens at [\d,.]+ tokens/s, time to first token [\d,.]+ ms, "
                        r"decode \d+ tokens at [\d,.]+ tokens/s", err[-1]), err
    assert cli.main(argv + ["--quiet"]) == 0
    assert "tokens/s" not in capsys.readouterr().err


# ----------------------------------------------------------------- memory

def test_memory_need_matches_the_loaded_weights():
    for name, quantize in (("default", None), ("tiny-moe", "int8")):
        engine = moe_infer.load(name, quantize=quantize, progress=False)
        held = sum(t.numel() * t.element_size() for t in (*engine.model.parameters(), *engine.model.buffers()))
        need = memory.memory_need(engine.config, engine.dtype)
        assert need.weights == held
        m = engine.config.model
        assert need.kv_per_token == 2 * m.num_layers * m.num_kv_heads * m.head_dim * engine.dtype.itemsize


def test_too_large_fails_before_allocating_with_what_would_fit(monkeypatch):
    with pytest.raises(ConfigError, match=r"mixtral-8x7b needs 18\d\.\d GB \(float32: weights .* GB \+ KV cache .* "
                                          r"for one 4096-token sequence\), but cpu has [\d.]+ GB available"):
        moe_infer.load("mixtral-8x7b", device="cpu", progress=False)
    cfg = load_preset("olmoe-1b-7b")
    full = memory.memory_need(cfg, torch.bfloat16).total
    int8 = memory.memory_need(cfg, torch.bfloat16, int8=True).total
    model = memory.meta_model(cfg)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (full + int8) // 2)
    with pytest.raises(ConfigError, match=r"it would fit with --quantize int8 \(7\.\d GB\), or 2 ranks of one "
                                          r"device each \(scripts/launch.sh -n 2 -- moe-infer \.\.\. --tp 2 --ep 2"):
        memory.check_fits(cfg, torch.bfloat16, torch.device("cuda"), model)


def test_int8_that_fits_only_quantized_is_staged_through_host_memory(monkeypatch):
    cfg = load_preset("olmoe-1b-7b")
    cfg.engine.quantize = "int8"
    model = memory.meta_model(cfg)
    full = memory.memory_need(cfg, torch.bfloat16, int8=False).total
    need = memory.memory_need(cfg, torch.bfloat16)
    assert need.weights < full / 1.8 and 0 < need.staging < need.weights
    monkeypatch.setattr(memory, "available_bytes", lambda device: full if device.type == "cpu" else full - 1)
    assert memory.check_fits(cfg, torch.bfloat16, torch.device("cuda"), model) is True
    monkeypatch.setattr(memory, "available_bytes", lambda device: full + 1)
    assert memory.check_fits(cfg, torch.bfloat16, torch.device("cuda"), model) is False


def test_quantize_model_moves_module_by_module():
    engine = moe_infer.load("tiny-moe", progress=False)
    ref = engine.logits([[1, 2, 3, 4]])
    staged = moe_infer.load("tiny-moe", quantize="int8", progress=False)
    from moe_infer.experts import quantize_model

    direct = moe_infer.load("tiny-moe", progress=False)
    quantize_model(direct.model, torch.device("cpu"))
    torch.testing.assert_close(direct.logits([[1, 2, 3, 4]]), staged.logits([[1, 2, 3, 4]]))
    assert (staged.logits([[1, 2, 3, 4]]) - ref).abs().max() < 0.1 * ref.abs().max()


# ----------------------------------------------------------------- several ranks

def mpiexec(n, *argv):
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpiexec (pip install mpich)")
    env = {"OMP_NUM_THREADS": "1"}
    import os

    return subprocess.run([exe, "-n", str(n), sys.executable, "-m", "moe_infer", *argv], capture_output=True,
                          text=True, timeout=180, env={**os.environ, **env})


def test_ranks_without_layout_flags_split_the_prompts_and_print_once():
    argv = ["generate", "--max-new-tokens", "12"] + [a for p in PROMPTS for a in ("--prompt", p)]
    alone = subprocess.run([sys.executable, "-m", "moe_infer", *argv, "--quiet"], capture_output=True, text=True,
                           timeout=120)
    two = mpiexec(2, *argv)
    assert alone.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == alone.stdout  # each continuation once, in order
    assert two.stderr.count("moe-infer: prompt") == 1 and two.stderr.count("loading default_model") <= 1


def test_an_error_on_every_rank_prints_once():
    out = mpiexec(2, "generate", "--prompt-ids", "99999")
    assert out.returncode != 0
    assert out.stderr.count("token id 99999 outside the vocabulary") == 1, out.stderr


def test_engine_splits_prompts_only_where_replicas_hold_their_experts():
    import dataclasses

    from moe_infer import Engine, ParallelConfig

    engine = moe_infer.load("tiny-moe", progress=False)
    assert not engine.split_prompts  # one rank
    for layout, split in ((ParallelConfig(dp=2), True), (ParallelConfig(tp=2, dp=2, ep=2), True),
                          (ParallelConfig(dp=2, ep=2), False), (ParallelConfig(tp=2, dp=3, ep=3, pcc=False), False)):
        cfg = dataclasses.replace(engine.config, parallel=layout)
        assert Engine(engine.model, cfg, None, memory._fake_groups(layout)).split_prompts is split, layout


def test_one_ranks_error_prints_once_with_its_rank(tmp_path):
    from safetensors.torch import load_file, save_file

    from hf_models import save_hf_model

    save_hf_model("qwen3_moe", tmp_path)  # 6 experts: with --ep 2, rank 1 reads experts 3 to 5 alone
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(n for n in tensors if ".experts.5." in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    out = mpiexec(2, "generate", "--checkpoint", str(tmp_path), "--ep", "2", "--prompt-ids", "1,2,3")
    assert out.returncode == 2
    assert out.stderr.count(f"[rank 1] {f}: tensor {name!r} has 1 NaN") == 1, out.stderr
    assert "rank 0" not in out.stderr and "Traceback" not in out.stderr


def test_without_layout_flags_a_configs_own_layout_stands(tmp_path):
    """No --tp / --pp / ... under a launcher: a model YAML's parallel section is the layout
    (it was overridden by data parallelism over the ranks); a config without one gets data
    parallelism over every rank; one rank gets the config as it is."""
    from moe_infer.cli import _default_layout, _parallel, build_parser

    assert _parallel(build_parser().parse_args(["generate", "--prompt", "x"]), 4) is None
    staged = tmp_path / "staged.yaml"
    staged.write_text((Path(__file__).resolve().parent.parent / "configs" / "tiny-moe.yaml").read_text() + "\nparallel: {pp: 2}\n")
    assert _default_layout(2, str(staged)) is None
    p = _default_layout(4, "tiny-moe")
    assert (p.dp, p.tp, p.pp) == (4, 1, 1)
    assert _default_layout(1, "tiny-moe") is None and _default_layout(2, None).dp == 2


def test_pipeline_stages_from_the_command_line_and_each_counts_its_own_blocks():
    from moe_infer.cli import _parallel, build_parser

    def layout(*flags, ranks=4):
        return _parallel(build_parser().parse_args(["generate", "--prompt", "x", *flags]), ranks)
    p = layout("--pp", "2")
    assert (p.pp, p.tp, p.dp) == (2, 1, 2)
    assert (layout("--pp", "2", "--tp", "2").dp, layout("--pp", "4").dp) == (1, 1)
    with pytest.raises(ConfigError, match=r"--tp=1 x --pp=3: expected a divisor of the 4 ranks this job runs"):
        layout("--pp", "3")
    cfg = load_preset("olmoe-1b-7b")
    whole = memory.memory_need(cfg, torch.bfloat16).weights
    staged = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=2))
    assert memory.memory_need(staged, torch.bfloat16).weights < 0.65 * whole  # the first stage's blocks
