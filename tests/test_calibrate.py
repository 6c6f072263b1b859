"""``moe-infer calibrate``: the profile it writes (the machine's figures, the MoE kernel on
each share of the models' experts, the links under two ranks) and what ``plan`` and the
cost model read from it."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_infer.cli import main
from moe_infer.config import ParallelConfig
from moe_infer.costmodel import CostModel
from moe_infer.hardware_profile import Hardware
from moe_infer.loader import resolve_config

ROOT = Path(__file__).resolve().parent.parent


def test_calibrate_writes_a_profile_plan_reads(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--name", "here"]) == 0
    hw = Hardware.load(out)
    assert hw.name == "here" and hw.mem_gbps > 0 and hw.matmul_tflops["bfloat16"] > 0 and hw.cpu_matmul_gbps > 0
    assert "links not measured" in hw.source
    assert len(hw.moe_read) == 2 and all(sorted(by) == [1, 4] and all(v > 0 for v in by.values())
                                         for by in hw.moe_read.values())
    curve = hw.matmul_curve["bfloat16"]
    assert sorted(curve) == [1, 8, 32] and all(rate > 0 for rate in curve.values())
    assert sorted(hw.attention_curve) == ["causal", "causal-graph", "masked", "masked-graph"]
    assert all(sorted(by) == [16, 64] and all(rate > 0 for rate in by.values())
               for kind in hw.attention_curve.values() for by in kind.values())
    assert hw.attention_rate("causal", 32, 32, 32) > 0
    assert hw.moe_kernel == {}  # no --models
    assert hw.prefill_call_us > 0  # the embedded model's time to its first token, beyond its forward
    capsys.readouterr()
    assert main(["plan", "--model", "tiny-moe", "--gpus", "1", "--hardware", str(out)]) == 0
    assert "tiny-moe on 1 x here" in capsys.readouterr().out


def test_calibrate_times_the_moe_kernel_on_each_share_of_the_models_experts(tmp_path, capsys):
    """``--models``: the kernel on every share a layout of up to ``--moe-ranks`` GPUs gives a
    rank (E / ep experts, each F / s wide), by the tokens of a call; ``plan`` then prices
    those layers from it. Bad values are refused with one line naming the option."""
    from moe_infer.calibrate import moe_shares
    from moe_infer.hardware_profile import moe_kernel_key

    assert moe_shares(8, 64, (1, 2)) == [(1, 1), (1, 2), (2, 1)]
    assert moe_shares(6, 64, (1, 2, 4)) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]  # 4 does not divide 6 experts
    out = tmp_path / "moe.yaml"
    assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--models", "tiny-moe",
                 "--moe-ranks", "1,2"]) == 0
    hw, cfg = Hardware.load(out), resolve_config("tiny-moe")
    m, e = cfg.model, cfg.moe
    keys = {moe_kernel_key(e.num_experts // ep, e.num_experts, m.hidden_size, e.expert_hidden // s, e.top_k,
                           m.activation) for ep, s in moe_shares(e.num_experts, e.expert_hidden, (1, 2))}
    assert set(hw.moe_kernel) == keys and len(keys) == 3
    assert all(sorted(by) == [1, 4] and all(us > 0 for us in by.values()) for by in hw.moe_kernel.values())
    whole = moe_kernel_key(e.num_experts, e.num_experts, m.hidden_size, e.expert_hidden, e.top_k, m.activation)
    model = CostModel(cfg, hw)
    assert model._ffn(ParallelConfig(), cfg.moe.first_dense, 1, 1)[2] == pytest.approx(
        hw.moe_kernel[whole][1] * 1e-6)
    for bad, match in ((["--models", "gpt-j-6b"], "not a mixture-of-experts"),
                       (["--models", "tiny-moe", "--moe-ranks", "0"], "--moe-ranks 0"),
                       (["--moe-ranks", "2"], "with --models only")):
        capsys.readouterr()
        assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), *bad]) == 2
        assert match in capsys.readouterr().err


def test_calibrate_times_the_call_with_the_shared_experts_folded_in(tmp_path):
    """A model whose shared experts the loader folds into the routed call on one GPU
    (``Config.folded_experts``) is also timed as that call: E + n experts, k + n slots. The
    cost model then prices a one-GPU layer's routed and shared experts by it, and a
    layout that does not fold (tp2) by the routed share's time plus the shared MLP."""
    import yaml

    from moe_infer.hardware_profile import moe_kernel_key

    raw = yaml.safe_load((ROOT / "configs" / "tiny-moe.yaml").read_text())
    raw["name"] = "tiny-folding"
    raw["moe"].update(shared_expert_gate=False, shared_experts=2, shared_expert_hidden=128)
    path = tmp_path / "tiny-folding.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = resolve_config(str(path))
    assert cfg.folded_experts() == 2 and cfg.folded_experts(ParallelConfig(tp=2)) == 0
    out = tmp_path / "fold.yaml"
    assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--models", str(path),
                 "--moe-ranks", "1,2", "--moe-tokens", "1,4"]) == 0
    hw, m, e = Hardware.load(out), cfg.model, cfg.moe
    folded = moe_kernel_key(8, 8, m.hidden_size, e.expert_hidden, 4, m.activation)
    routed = moe_kernel_key(6, 6, m.hidden_size, e.expert_hidden, 2, m.activation)
    assert folded in hw.moe_kernel and routed in hw.moe_kernel
    cm = CostModel(cfg, hw)
    assert cm._ffn(ParallelConfig(), 0, 4, 4) == pytest.approx((0.0, 0.0, hw.moe_kernel[folded][4] * 1e-6, 0.0))
    reads, seconds, timed, _ = cm._ffn(ParallelConfig(tp=2), 0, 4, 4)
    half = moe_kernel_key(6, 6, m.hidden_size, e.expert_hidden // 2, 2, m.activation)
    assert timed == pytest.approx(hw.moe_kernel[half][4] * 1e-6) and reads > 0 and seconds > 0


def test_calibrate_keeps_what_it_measured_when_cut_short(tmp_path, monkeypatch):
    """The profile is written as it grows: a run stopped while timing the second model's
    kernel (a job's time limit) leaves the machine's figures and the first model's shares,
    at the ``--moe-tokens`` asked for."""
    from moe_infer import calibrate

    real, seen = calibrate._moe_kernel, []

    def cut(device, models, *args, **kw):
        seen.append(models[0].name)
        if len(seen) == 2:
            raise KeyboardInterrupt  # as the job's limit stops it
        return real(device, models, *args, **kw)

    monkeypatch.setattr(calibrate, "_moe_kernel", cut)
    out = tmp_path / "cut.yaml"
    with pytest.raises(KeyboardInterrupt):
        main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--models", "tiny-moe,olmoe-1b-7b",
              "--moe-tokens", "2,3"])
    assert seen == ["tiny-moe", "olmoe-1b-7b"]
    hw, e = Hardware.load(out), resolve_config("tiny-moe").moe
    assert hw.mem_gbps > 0 and hw.moe_read
    assert hw.moe_kernel and all(f"/{e.num_experts}:" in key for key in hw.moe_kernel)  # tiny-moe's shares only
    assert all(sorted(by) == [2, 3] for by in hw.moe_kernel.values())
    assert main(["calibrate", "--smoke", "--device", "cpu", "--out", str(out), "--models", "tiny-moe",
                 "--moe-tokens", "2,x"]) == 2


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (the test extras install mpich)")
def test_calibrate_under_two_ranks_measures_the_link(tmp_path):
    out = tmp_path / "two.yaml"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "launch.sh"), "-n", "2", "--", sys.executable, "-m",
                          "moe_infer", "calibrate", "--smoke", "--device", "cpu", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    hw = Hardware.load(out)
    assert hw.nvlink.alpha_us > 0 and hw.nvlink.gbps > 0
    assert "all-reduces over 2 ranks (latency: eager all-reduces)" in hw.source
    # every collective measured over the one group size two ranks form, at each smoke size
    assert sorted(hw.collectives) == ["all_gather", "all_reduce", "all_reduce_nccl", "all_to_all"]
    for kind, by_ranks in hw.collectives.items():
        assert sorted(by_ranks) == [2] and len(by_ranks[2]) == 2 and all(us > 0 for us in by_ranks[2].values())
        assert hw.collective_s(kind, 1.0, 2) > 0 and hw.collective_s(kind, 1.0, 4) is None
