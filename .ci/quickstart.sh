#!/usr/bin/env bash
# The README's first quick-start command, read from README.md and run as written from the
# repository root in a fresh virtual environment: what a new user on a CPU machine runs
# (torch's CPU wheel; no Triton, no CuPy). Passes when it prints the prompt followed by
# generated text.
set -euo pipefail
cd "$(dirname "$0")/.."
command=$(python3 .ci/readme.py block 1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== README quick start, in a fresh virtual environment: $command"
python3 -m venv "$tmp/v"
rc=0
(unset PYTHON; . "$tmp/v/bin/activate" && bash -c "$command") >"$tmp/out" 2>"$tmp/err" || rc=$?
if [ "$rc" -ne 0 ]; then
    echo "CI: the README's quick start failed with exit code $rc: $command" >&2
    echo "-- its output:" >&2
    tail -n 20 "$tmp/out" >&2
    echo "-- its errors (the last 40 lines):" >&2
    tail -n 40 "$tmp/err" >&2
    exit 1
fi
python3 .ci/readme.py check "$tmp/out"
cat "$tmp/out"
