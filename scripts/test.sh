#!/usr/bin/env bash
# The test command: sets up the environment (with the `test` extra) and runs pytest.
#   scripts/test.sh            the fast tier: every module and every numerics contract, tests
#                              not marked `slow` (README: minutes on 2 cores)
#   scripts/test.sh --all      everything, the slow end-to-end tests included (what CI runs)
# Other arguments go to pytest, e.g. scripts/test.sh tests/quant -x
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not slow")
args=()
for a in "$@"; do
  if [ "$a" = "--all" ]; then tier=(); else args+=("$a"); fi
done
NVFP4_JAX_EXTRAS=test
source scripts/setup_env.sh
exec "$PY" -m pytest -q "${tier[@]}" "${args[@]}"
