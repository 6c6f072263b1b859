#!/usr/bin/env bash
# Installs moe-infer from this checkout (editable); `install.sh test` adds the test extras.
# A torch that is already installed (a CUDA build on a GPU machine) is kept; a machine
# without torch gets the CPU wheel torch==2.13.0, never a CUDA build pulled in by a range.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
$py -c "import torch" 2>/dev/null || $py -m pip install -q "torch==2.13.0"
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
$py -m pip install -q -e ".$extras"
# pyenv puts console scripts on PATH only after a rehash.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash; fi
