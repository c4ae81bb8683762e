#!/usr/bin/env bash
# The test command: sets up the environment (with the `test` extra) and runs pytest.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/quant -x
set -euo pipefail
cd "$(dirname "$0")/.."
NVFP4_JAX_EXTRAS=test
source scripts/setup_env.sh
exec "$PY" -m pytest -q "$@"
