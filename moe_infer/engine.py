"""The generation engine: prefill, then decode into a preallocated KV cache.

Shape letters: B batch, L prompt slots (longest prompt), S cache slots, V vocab.
A batch of prompts is left-padded so every row writes the same cache slot each step;
``key_valid`` masks the padding and positions are counted per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_infer.config import Config
from moe_infer.model import Transformer
from moe_infer.sampling import SamplingParams, sample
from moe_infer.tokenizer import Tokenizer


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, without the prompt and without the EOS token
    text: str | None  # decoded when the engine has a tokenizer
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens)


class Engine:
    def __init__(self, model: Transformer, config: Config, tokenizer: Tokenizer | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        p = model.embed.weight
        self.device, self.dtype = p.device, p.dtype
        self.eos = set(config.model.eos_token_ids)

    # ----------------------------------------------------------------- inputs

    def encode(self, prompts) -> list[list[int]]:
        """Strings or token-id lists (one, or a list of them) -> validated id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts: expected a string, a list of strings or a list of "
                             f"token-id lists, got {type(prompts).__name__} {prompts!r:.60}")
        vocab = self.config.model.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"prompts[{i}]: empty prompt; give at least one token")
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}]: this model has no tokenizer; pass token ids")
                ids = self.tokenizer.encode(p)
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = list(p)
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ValueError(f"prompts[{i}]: token id {bad} outside the vocabulary [0, {vocab})")
            else:
                raise ValueError(f"prompts[{i}]: expected a string or a list of int token ids, got {p!r:.60}")
            if not ids:
                raise ValueError(f"prompts[{i}]: empty prompt; give at least one token")
            out.append(ids)
        return out

    # ----------------------------------------------------------------- one full forward

    @torch.no_grad()
    def logits(self, input_ids, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One forward without a cache -> float32 logits [B, L, V].

        ``input_ids`` is a [B, L] tensor (with an optional [B, L] mask of real tokens, left
        or right padding) or a list of id lists of any lengths, right-padded here.
        Padding positions of the result are 0.
        """
        if not torch.is_tensor(input_ids):
            rows = self.encode(input_ids)
            width = max(map(len, rows))
            input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
            attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [B, L], got shape {list(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {list(attention_mask.shape)}: expected the shape "
                             f"of input_ids {list(input_ids.shape)}")
        ids = input_ids.to(self.device)
        valid = attention_mask.to(self.device).bool()
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
        ctx = self.model.context(positions, valid, positions, start=0)
        out = self.model(ids, ctx).float()
        return out.masked_fill(~valid.unsqueeze(-1), 0.0)

    # ----------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> list[Completion]:
        params = SamplingParams(temperature, top_k, top_p, seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
        rows = self.encode(prompts)
        limit = self.config.max_seq_len
        for i, r in enumerate(rows):
            if len(r) + max_new_tokens > limit:
                raise ValueError(f"prompts[{i}]: {len(r)} prompt tokens + max_new_tokens="
                                 f"{max_new_tokens} exceed max_seq_len={limit}")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        out = []
        step = self.config.engine.max_batch_size  # larger requests run in several batches
        for lo in range(0, len(rows), step):
            out += self._generate_batch(rows[lo:lo + step], max_new_tokens, params, generator)
        return out

    def _generate_batch(self, rows, max_new, params, generator) -> list[Completion]:
        b, width = len(rows), max(map(len, rows))
        slots = width + max_new
        pad = torch.tensor([width - len(r) for r in rows], device=self.device)  # [B]
        tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=self.device)
        slot = torch.arange(slots, device=self.device)
        key_valid = slot[None, :] >= pad[:, None]  # [B, S]: padding slots never attend
        positions = (slot[None, :] - pad[:, None]).clamp(min=0)  # [B, S]
        cache = self.model.make_cache(b, slots)

        logits = self._prefill(tokens, key_valid[:, :width], positions[:, :width], cache)
        generated = [[] for _ in range(b)]
        finish = [None] * b
        for t in range(max_new):
            nxt = sample(logits, params, generator)  # [B]
            for i, tok in enumerate(nxt.tolist()):  # the one host sync per token
                if finish[i] is None:
                    if tok in self.eos:
                        finish[i] = "stop"
                    else:
                        generated[i].append(tok)
            if all(f is not None for f in finish) or t == max_new - 1:
                break
            s = width + t
            logits = self._decode(nxt, s, key_valid[:, :s + 1], positions[:, :s + 1], cache)
        return [Completion(g, self.tokenizer.decode(g) if self.tokenizer else None, f or "length")
                for g, f in zip(generated, finish)]

    def _prefill(self, tokens, key_valid, positions, cache) -> torch.Tensor:
        """tokens [B, L] -> logits of the last prompt slot [B, V]."""
        ctx = self.model.context(positions, key_valid, positions, start=0)
        return self.model(tokens, ctx, cache, last_only=True)[:, -1]

    def _decode(self, tokens, slot: int, key_valid, positions, cache) -> torch.Tensor:
        """tokens [B] written at cache slot ``slot`` -> next logits [B, V]."""
        ctx = self.model.context(positions[:, slot:slot + 1], key_valid, positions, start=slot)
        return self.model(tokens[:, None], ctx, cache, last_only=True)[:, -1]
