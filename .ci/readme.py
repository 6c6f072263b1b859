"""The README's quick start, read from README.md at run time so that CI runs what a new user
copies, not a copy of it.

  python3 .ci/readme.py block N      prints the Nth ```bash block under '## Quick start'
  python3 .ci/readme.py check FILE   checks that FILE (the first block's standard output)
                                     holds the first block's --prompt with a continuation
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
HEADING = "## Quick start"


def fail(message: str) -> None:
    sys.exit(f"CI: {message}")


def quick_start_blocks() -> list[str]:
    """The ```bash fenced blocks of the Quick start section, in order."""
    lines = README.read_text().splitlines()
    if HEADING not in lines:
        fail(f"{README.name} has no '{HEADING}' heading")
    start = lines.index(HEADING) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    blocks, body = [], None
    for line in lines[start:end]:
        if body is None and line.strip() == "```bash":
            body = []
        elif body is not None and line.strip() == "```":
            blocks.append("\n".join(body))
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def block(n: int) -> str:
    blocks = quick_start_blocks()
    if not 1 <= n <= len(blocks):
        fail(f"{README.name}: '{HEADING}' has {len(blocks)} ```bash blocks, not a block {n}")
    return blocks[n - 1]


def prompt_of(command: str) -> str:
    """The --prompt argument of the quick start's generate command."""
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--prompt" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--prompt="):
            return word.split("=", 1)[1]
    fail(f"the quick start's command has no --prompt: {command}")


CORPUS = README.parent / "moe_infer" / "default_model" / "corpus.txt"


def check(output_file: str) -> None:
    """The generate command prints each prompt followed by its continuation, and the
    embedded model (trained on CORPUS, decoding greedily) continues the sonnet line as the
    text it learned goes on."""
    prompt, out = prompt_of(block(1)), Path(output_file).read_text()
    if prompt not in out:
        fail(f"the quick start's output does not contain its prompt {prompt!r}; it printed:\n{out}")
    continuation = out.split(prompt, 1)[1]
    if not continuation.strip():
        fail(f"the quick start printed its prompt {prompt!r} with no continuation; it printed:\n{out}")
    words = " ".join((prompt + continuation).split()[:len(prompt.split()) + 4])
    if words not in " ".join(CORPUS.read_text().split()):
        fail(f"the quick start's continuation is not the sonnet's: {words!r} is not in {CORPUS.name}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "block" and sys.argv[2].isdigit():
        print(block(int(sys.argv[2])))
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        fail(f"usage: {sys.argv[0]} block N | check FILE")
