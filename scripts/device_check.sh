#!/usr/bin/env bash
# Numerics on the accelerator JAX finds, against the CPU of the same process and the spec
# (the checks live in nvfp4_jax/device_check.py; tests/test_device_check.py runs them on CPU).
#
#   scripts/device_check.sh [--quick] [--skip-kernels] [--out DIR]
#
# Uses the python3 on PATH with its own jax (e.g. a GPU image's jax 0.11) and the package from
# this working tree; installs nothing and does not force a platform. Writes device_check.json
# to $OUT if set, else benchmarks/results/gpu/. Budget: a few minutes on a GPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m nvfp4_jax.device_check "$@"
