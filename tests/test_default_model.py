"""The embedded default model: continues its training text, and is a valid Mixtral checkpoint."""
import subprocess
import sys

import torch

import moe_infer
from moe_infer.config_files import DEFAULT_MODEL
from parity import check_logits

LINES = (DEFAULT_MODEL / "corpus.txt").read_text().splitlines()
PROMPTS = ["Shall I compare thee to a summer's day?", "Let me not to the marriage of true minds",
           "That time of year thou mayst in me behold"]


def test_greedy_continuations_follow_the_text(device_dtype):
    device, dtype = device_dtype
    outs = moe_infer.load(device=device, dtype=dtype, progress=False).generate(PROMPTS, max_new_tokens=40)
    for prompt, out in zip(PROMPTS, outs):
        i = LINES.index(prompt)
        expected = "\n" + "\n".join(LINES[i + 1:i + 3])
        n = min(len(out.text), len(expected))
        assert n > 40 and out.text[:n] == expected[:n], (prompt, out.text)


def test_same_logits_as_transformers_mixtral(device_dtype):
    from transformers import MixtralForCausalLM

    device, dtype = device_dtype
    hf = MixtralForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    engine = moe_infer.load(device=device, dtype=dtype, progress=False)
    exact = moe_infer.load(device="cpu", dtype=torch.float32, progress=False)
    check_logits(engine, exact, hf, [engine.tokenizer.encode(p) for p in PROMPTS], "default model")


def test_cli_runs_the_default_model_with_no_other_argument():
    line = "My mistress' eyes are nothing like the sun;"
    out = subprocess.run([sys.executable, "-m", "moe_infer", "generate", "--prompt", line,
                          "--max-new-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nxt = LINES[LINES.index(line) + 1]
    assert out.stdout.startswith(line + "\n" + nxt[:20]), out.stdout
