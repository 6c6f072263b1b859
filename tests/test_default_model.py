"""The embedded default model: continues its training text, and is a valid Mixtral checkpoint."""
import subprocess
import sys

import pytest
import torch

import moe_infer
from moe_infer.config import DEFAULT_MODEL

LINES = (DEFAULT_MODEL / "corpus.txt").read_text().splitlines()
PROMPTS = ["Shall I compare thee to a summer's day?", "Let me not to the marriage of true minds",
           "That time of year thou mayst in me behold"]


@pytest.fixture(scope="module")
def engine():
    return moe_infer.load(progress=False)


def test_greedy_continuations_follow_the_text(engine):
    outs = engine.generate(PROMPTS, max_new_tokens=40)
    for prompt, out in zip(PROMPTS, outs):
        i = LINES.index(prompt)
        expected = "\n" + "\n".join(LINES[i + 1:i + 3])
        n = min(len(out.text), len(expected))
        assert n > 40 and out.text[:n] == expected[:n], (prompt, out.text)


def test_same_logits_as_transformers_mixtral(engine, device_dtype):
    from transformers import MixtralForCausalLM

    device, dtype = device_dtype
    hf = MixtralForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ids = [engine.tokenizer.encode(p) for p in PROMPTS]
    ours = moe_infer.load(device=device, dtype=dtype, progress=False).logits(ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, row in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([row])).logits[0].double()
        err = ((ours[i, :len(row)].cpu().double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"prompt {i}: relative error {err:.2e}"


def test_cli_runs_the_default_model_with_no_other_argument():
    line = "My mistress' eyes are nothing like the sun;"
    out = subprocess.run([sys.executable, "-m", "moe_infer", "generate", "--prompt", line,
                          "--max-new-tokens", "12"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    nxt = LINES[LINES.index(line) + 1]
    assert out.stdout.startswith(line + "\n" + nxt[:20]), out.stdout
