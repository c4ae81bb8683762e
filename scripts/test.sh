#!/usr/bin/env bash
# The test command: sets up the environment (with the `test` extra) and runs pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/quant -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test
exec "$PY" -m pytest -q "$@"
