#!/usr/bin/env python
"""Train the tiny Mixtral model that ships in moe_infer/default_model.

The model exists so that tests and demos have a real (if tiny) mixture-of-experts
checkpoint with a known, checkable behaviour: it has memorised corpus.txt (seven
Shakespeare sonnets), so prompting it with any line of the corpus and decoding
greedily reproduces the lines that follow.

Everything is deterministic and offline: the tokenizer is trained here from the
corpus, the model is initialised from a seed, and nothing is downloaded.

    python scripts/train_default_model.py --out moe_infer/default_model
"""

import argparse
import math
import os
import random
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import MixtralConfig, MixtralForCausalLM

EOS = "</s>"  # id 0: appended after the last line so the model learns to stop
PAD = "<pad>"  # id 1: only fills the tail of windows that run past the end of the text

# Files that save_pretrained writes and that the package actually needs.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")


def parse_args():
    default_out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "moe_infer", "default_model")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.normpath(default_out), help="output directory (must contain corpus.txt unless --corpus is given)")
    p.add_argument("--corpus", default=None, help="training text; defaults to OUT/corpus.txt")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=96, help="training window length in tokens")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-pass", type=float, default=0.95, help="exit non-zero if fewer lines than this fraction verify")
    return p.parse_args()


def train_tokenizer(text, vocab_size):
    """Byte-level BPE, so any string round-trips exactly: decode(encode(s)) == s."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a prompt that starts a line must tokenize exactly as that
    # line does inside the corpus, where it follows "\n" rather than a space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        # All 256 byte symbols, not only those seen in the corpus, so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    return tok


def build_model(vocab_size, eos_id):
    config = MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=224,  # per expert
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as in the real Mixtral
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=None,
        attention_dropout=0.0,
        router_jitter_noise=0.0,
        # The load-balancing loss keeps all four experts in use, so that routing in the
        # shipped model actually exercises every expert.
        router_aux_loss_coef=0.02,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    return MixtralForCausalLM(config)


def make_windows(line_ids, seq_len, pad_id):
    """One training window per corpus line, starting at that line's first token.

    Starting every window at a line boundary teaches the model to continue a line that
    is given with no preceding context, which is exactly how the model is prompted.
    """
    stream = [t for ids in line_ids for t in ids]
    starts, pos = [], 0
    for ids in line_ids[:-1]:  # the last "line" is the lone EOS token
        starts.append(pos)
        pos += len(ids)
    inputs = torch.full((len(starts), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(starts), seq_len), dtype=torch.long)
    for i, s in enumerate(starts):
        chunk = stream[s : s + seq_len]
        inputs[i, : len(chunk)] = torch.tensor(chunk)
        mask[i, : len(chunk)] = 1
    labels = inputs.masked_fill(mask == 0, -100)  # no loss on padding
    return inputs, mask, labels


def train(model, inputs, mask, labels, args):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warm-up, then cosine decay to 5% of the peak
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.empty(0, dtype=torch.long)
    model.train()
    t0 = time.time()
    for step in range(args.steps):
        # Walk through shuffled epochs so every line start is seen equally often.
        if len(order) < args.batch_size:
            order = torch.cat([order, torch.randperm(len(inputs), generator=gen)])
        idx, order = order[: args.batch_size], order[args.batch_size :]
        out = model(input_ids=inputs[idx], attention_mask=mask[idx], labels=labels[idx], output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {out.loss.item():.4f}  aux {out.aux_loss.item():.3f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:6.1f}s", flush=True)
    return time.time() - t0


def save(model, tok, out):
    # Training-only switches off, so the saved config describes plain inference.
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = tok.token_to_id(PAD)
    # Save to a scratch directory and copy only what is needed, so nothing stray lands in OUT.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in MODEL_FILES:
            if os.path.exists(os.path.join(tmp, name)):
                shutil.copyfile(os.path.join(tmp, name), os.path.join(out, name))
    tok.save(os.path.join(out, "tokenizer.json"))


@torch.no_grad()
def verify(out, lines, max_new_tokens=32, n_chars=40):
    """Reload the saved files and check that each line's greedy continuation matches the corpus."""
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    model = MixtralForCausalLM.from_pretrained(out).eval()
    text = "".join(line + "\n" for line in lines)
    assert tok.decode(tok.encode(text).ids) == text, "tokenizer does not round-trip the corpus"

    passed, failures = 0, []
    checked = len(lines) - 1  # the last line has no following line to predict
    for i in range(checked):
        prompt = lines[i] + "\n"
        expected = "".join(line + "\n" for line in lines[i + 1 :])[:n_chars]
        ids = torch.tensor([tok.encode(prompt).ids])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
        continuation = tok.decode(gen[0, ids.shape[1] :].tolist())
        if continuation.startswith(expected):
            passed += 1
        else:
            failures.append((prompt, expected, continuation))
    for prompt, expected, got in failures:
        print(f"FAIL  prompt {prompt!r}\n      expected {expected!r}\n      got      {got[:n_chars]!r}")
    print(f"verified {passed}/{checked} lines ({passed / checked:.1%}) continue correctly")
    return passed / checked


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    corpus = args.corpus or os.path.join(args.out, "corpus.txt")
    with open(corpus, encoding="utf-8") as f:
        lines = f.read().splitlines()
    text = "".join(line + "\n" for line in lines)

    tok = train_tokenizer(text, args.vocab_size)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    # Encoding line by line equals encoding the whole text, because "\n" is always its
    # own pre-token; it also gives the token offset of every line start for free.
    line_ids = [tok.encode(line + "\n").ids for line in lines] + [[eos_id]]
    assert sum(line_ids, []) == tok.encode(text).ids + [eos_id]
    n_tokens = sum(map(len, line_ids))
    print(f"corpus: {len(lines)} lines, {len(text)} chars, {n_tokens} tokens (vocab {tok.get_vocab_size()})")

    model = build_model(tok.get_vocab_size(), eos_id)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    inputs, mask, labels = make_windows(line_ids, args.seq_len, pad_id)
    seconds = train(model, inputs, mask, labels, args)
    print(f"training took {seconds:.0f}s")

    save(model, tok, args.out)
    fraction = verify(args.out, lines)
    if fraction < args.min_pass:
        sys.exit(f"only {fraction:.1%} of lines verified (need {args.min_pass:.0%})")


if __name__ == "__main__":
    main()
