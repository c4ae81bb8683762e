#!/usr/bin/env bash
# NVFP4 pre-training example.
#
#   recipes/nvfp4_example.sh [key=value ...]
#   QUANTIZATION=te_fp8_delayedscaling recipes/nvfp4_example.sh      # the FP8 baseline
#
# On Blackwell GPUs with Transformer Engine: Llama 3 8B, te_nvfp4, 8k context, batch 4 per GPU,
# FSDP over the local GPUs, 50 steps (NVIDIA's MaxText example). Anywhere else: the tiny preset on
# the bundled Shakespeare corpus with the bit-exact emulated recipe. Extra key=value arguments
# override either. Sets up its own virtual environment on first use (outside a container that
# already has the package).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if [ -n "${NVFP4_JAX_PYTHON:-}" ]; then
  PY="$NVFP4_JAX_PYTHON"          # e.g. the container's python, package already installed
else
  NVFP4_JAX_EXTRAS=""             # the package alone; setup_env.sh never reads our arguments
  source scripts/setup_env.sh
fi

# Blackwell (compute capability 10.x) with a Transformer Engine that runs te_nvfp4? The run's own
# backend resolver answers (quantization_backend=te); if not, say why.
te_args=()
if te_reason="$("$PY" - <<'PYEOF'
import sys
from nvfp4_jax.quant import TEUnavailableError, get_recipe, resolve_backend
try:
    resolve_backend("te", get_recipe("te_nvfp4"))
except (TEUnavailableError, ValueError) as err:
    print(err)
    sys.exit(1)
PYEOF
)"; then
  config=recipes/configs/llama3-8b.yml
  te_args=("quantization_backend=te")
  echo "[nvfp4_example] Blackwell + Transformer Engine found: Llama 3 8B on TE's FP4 kernels"
else
  config=recipes/configs/tiny.yml
  echo "[nvfp4_example] Transformer Engine not used: ${te_reason:-its probe failed (see above)}"
  echo "[nvfp4_example] tiny Llama; quantization_backend=auto: emulated NVFP4 unless jax.nn.scaled_matmul reaches FP4 tensor cores"
fi

args=()
if [ -n "${QUANTIZATION:-}" ]; then args+=("quantization=$QUANTIZATION"); fi
exec "$PY" -m nvfp4_jax.train "$config" ${te_args[@]+"${te_args[@]}"} ${args[@]+"${args[@]}"} "$@"
