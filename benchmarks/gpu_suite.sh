#!/usr/bin/env bash
# One-call GPU benchmark: train step of a 1.1B Llama under bf16 / FP8 / NVFP4 with MFU, where
# NVFP4's extra time goes, and whether FP8 GEMMs reach FP8 tensor cores (see gpu_suite.py).
# Uses the image's own jax/flax/optax/orbax and the working tree on PYTHONPATH; installs nothing.
# Writes JSON to $OUT (when set) and, on a GPU, to benchmarks/results/gpu/. Without a GPU it runs
# small shapes so the script can be tried anywhere. Extra arguments go to gpu_suite.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_suite.py "$@"
