"""A thin wrapper over a Hugging Face ``tokenizers`` tokenizer.json."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # tokenizers raises a plain Exception for bad files
            raise ValueError(f"{self.path}: not a valid tokenizer.json ({exc})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def decode_delta(tokenizer, ids: list[int], at: tuple[int, int],
                 final: bool = False) -> tuple[str, tuple[int, int]]:
    """Incremental detokenizing, ``at`` = (prefix, read): the text that ``ids[read:]`` adds,
    decoding only a short window from ``prefix`` (so a token costs the same at any length),
    and the next (prefix, read). Decoding a window rather than the new tokens alone keeps what depends
    on the tokens before (a leading space, a UTF-8 character split over tokens) as a full
    decode has it; text ending in an incomplete character waits for the next token unless
    ``final``."""
    prefix, read = at
    before = tokenizer.decode(ids[prefix:read])
    text = tokenizer.decode(ids[prefix:])
    if len(text) > len(before) and (final or not text.endswith("\ufffd")):
        return text[len(before):], (read, len(ids))
    return "", at
