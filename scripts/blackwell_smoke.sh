#!/usr/bin/env bash
# Smoke test for a Blackwell GPU machine with the container (docker/): a few minutes.
#
#   scripts/blackwell_smoke.sh            # inside the container, from the repository root
#
# 1. Transformer Engine's version and its own support test for each recipe.
# 2. One quantized projection per recipe under te, xla and emulated, compared within tolerance,
#    with proof from the compiled HLO that TE's GEMM / cuDNN's block-scaled FP4 GEMM ran.
# 3. The tiny preset, 3 steps, on 1 GPU and on all GPUs: save a checkpoint at step 2, then
#    resume from it to step 3 (restore), under quantization_backend=te where TE runs te_nvfp4,
#    else auto.
# Uses $PYTHON (default python3) with the package from this tree; installs nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"

echo "== 1-2: Transformer Engine, and one projection per recipe and backend"
"$PY" scripts/blackwell_smoke.py

backend=auto
if "$PY" -c "import sys; from nvfp4_jax.quant import get_recipe; from nvfp4_jax.quant.te_backend import te_unavailable_reason as r; sys.exit(1 if r(get_recipe('te_nvfp4')) else 0)"; then
  backend=te
fi

run_tiny() {  # $1: label; the rest: extra key=value
  local label="$1"; shift
  local args=(recipes/configs/tiny.yml quantization=te_nvfp4 "quantization_backend=$backend"
              "base_output_directory=$out" "run_name=smoke-$label" checkpoint_period=2
              eval_interval=1000 log_period=1 "$@")
  echo "== 3: tiny preset on $label, quantization_backend=$backend: steps 1-2 and a checkpoint"
  "$PY" -m nvfp4_jax.train "${args[@]}" steps=2
  echo "== 3: resume on $label from the step-2 checkpoint to step 3"
  "$PY" -m nvfp4_jax.train "${args[@]}" steps=3 | tee "$out/smoke-$label.log"
  grep -q "Resumed from checkpoint step 2" "$out/smoke-$label.log"
}

CUDA_VISIBLE_DEVICES=0 run_tiny 1gpu ici_fsdp_parallelism=1
run_tiny allgpus ici_fsdp_parallelism=-1
echo "blackwell_smoke: all passed (runs in $out)"
