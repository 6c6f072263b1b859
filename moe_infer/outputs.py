"""What a server step hands back to the host: the sampled tokens and the log-probabilities
asked for, on their way in one copy (``Sampled``), and their host form (``Logprob``)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Logprob(NamedTuple):
    """A token's log-probability under the raw model output, and the ``top`` most likely
    tokens there as (id, logprob), most likely first (None for a prompt's first token)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """logits [N, V], the tokens taken [N], top count k -> (logprob of each token [N],
    top-k logprobs [N, k], their ids [N, k]), on the device."""
    lp = logits.float().log_softmax(dim=-1)
    top = lp.topk(k, dim=-1)
    return lp.gather(-1, tokens[:, None])[:, 0], top.values, top.indices


def top_pairs(ids: list, vals: list, row: int, k: int) -> list[tuple[int, float]]:
    """Row ``row`` of flattened [N, k] top-k ids and logprobs -> [(id, logprob)]."""
    return list(zip(map(int, ids[row * k:(row + 1) * k]), vals[row * k:(row + 1) * k]))


class Sampled(NamedTuple):
    """One step's sampled tokens and log-probabilities on their way to the host: every part
    flattened into float64 (which holds token ids and float32 logprobs exactly) in one copy."""

    reqs: list  # [Request], one per row
    lp_rows: list[int]  # rows whose token logprobs were asked for
    scored: list  # [Request] whose prompt logprobs come with this token
    host: torch.Tensor  # the flat values (pinned on a GPU, the copy maybe still running)
    sizes: list[int]  # each part's length in ``host``
    ready: torch.cuda.Event | None  # recorded after the copy (None on a CPU)

    @staticmethod
    def start(reqs, lp_rows, scored, parts: list[torch.Tensor]) -> "Sampled":
        flat = torch.cat([t.reshape(-1).double() for t in parts])
        if flat.device.type != "cuda":
            return Sampled(reqs, lp_rows, scored, flat, [t.numel() for t in parts], None)
        host = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Sampled(reqs, lp_rows, scored, host, [t.numel() for t in parts], ready)

    def values(self) -> list[list]:
        """Waits for the copy -> the parts as host lists."""
        if self.ready is not None:
            self.ready.synchronize()
        flat, out, at = self.host.tolist(), [], 0
        for n in self.sizes:
            out.append(flat[at:at + n])
            at += n
        return out
