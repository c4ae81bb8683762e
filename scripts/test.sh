#!/usr/bin/env bash
# The test command: sets up the environment (with the `test` extra) and runs pytest.
#   scripts/test.sh            the fast tier: every module and every numerics contract, tests
#                              not marked `slow` (docs/testing.md: minutes on 2 cores)
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
# Tests are mostly single-threaded compiles: one pytest-xdist worker per core (by default at most
# 4: the 8-device tests need memory), work-stealing so the heavy tests spread out.
# NVFP4_JAX_TEST_WORKERS=0 runs in one process.
workers="${NVFP4_JAX_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
if [[ ! "$workers" =~ ^[0-9]+$ ]]; then
  echo "error: NVFP4_JAX_TEST_WORKERS='$workers' must be a whole number (0: no workers)" >&2
  exit 2
fi
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist worksteal)
exec "$PY" -m pytest -q "${parallel[@]}" "${tier[@]}" "${args[@]}"
