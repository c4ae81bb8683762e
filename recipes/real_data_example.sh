#!/usr/bin/env bash
# The real-data workflow end to end, on the bundled corpus (nothing is downloaded):
#
#   recipes/real_data_example.sh [key=value ...]      # e.g. steps=50
#
# 1. writes every speech of the bundled Shakespeare as one JSONL document (runs/real_data/corpus/),
# 2. `python -m nvfp4_jax.data prepare` tokenizes them (bytes, BOS/EOS) into ArrayRecord,
# 3. trains the tiny Llama on them, packed (several speeches per row, segment ids, positions),
# 4. `python -m nvfp4_jax.sample` continues a prompt from the newest checkpoint.
# With your own corpus, replace step 1 and pass --tokenizer to prepare (see README.md).
# Installs the `data` extra into the virtual environment on first use (outside a container).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

if [ -n "${NVFP4_JAX_PYTHON:-}" ]; then
  PY="$NVFP4_JAX_PYTHON"
else
  NVFP4_JAX_EXTRAS="data"
  source scripts/setup_env.sh
fi
work="${REAL_DATA_DIR:-runs/real_data}"
mkdir -p "$work/corpus"

"$PY" - "$work/corpus/speeches.jsonl" <<'PYEOF'
import json, sys
from nvfp4_jax.data import shakespeare_bytes
with open(sys.argv[1], "w") as f:
    for speech in shakespeare_bytes().decode("utf-8").split("\n\n"):
        if speech.strip():
            f.write(json.dumps({"text": speech}) + "\n")
PYEOF
"$PY" -m nvfp4_jax.data prepare --input "$work/corpus/speeches.jsonl" --output "$work/data" --overwrite
"$PY" -m nvfp4_jax.train recipes/configs/tiny.yml dataset_type=grain \
  grain_train_files="$work/data/documents.array_record" vocab_size=258 packing=true \
  base_output_directory="$work" run_name=run "$@"
"$PY" -m nvfp4_jax.sample "$work/run" --prompt $'ROMEO:\n' --max-new-tokens 200 --temperature 0.7 --top-k 40
