#!/usr/bin/env bash
# Sets up the test environment and runs the whole CPU test suite (GPU tests skip
# themselves without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec ${PYTHON:-python3} -m pytest -q --color=no "$@"
