#!/usr/bin/env bash
# A checkpoint written under one JAX leg resumed under the other, both ways, beside uninterrupted
# runs on each leg (tiny preset, bundled data, 6 steps, checkpoint at 3). One-off measurement:
# results/cross_version_resume.json holds the step losses read from the logs.
#   A=<python of the 3.11 / jax 0.10.2 env> B=<python of the 3.12 / jax 0.12 env> OUT=/tmp/xv \
#     bash benchmarks/cross_version_resume.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${A:?python of the JAX 0.10.2 environment}" "${B:?python of the JAX 0.12 environment}"
OUT="${OUT:-/tmp/xv}"
common="recipes/configs/tiny.yml steps=6 checkpoint_period=3 log_period=1 base_output_directory=$OUT"
# 3.11 writes steps 1-3 and a checkpoint, 3.12 resumes to 6; and the other way round
$A -m nvfp4_jax.train $common run_name=a2b steps=3 > $OUT/a2b_1.log 2>&1
$B -m nvfp4_jax.train $common run_name=a2b > $OUT/a2b_2.log 2>&1
$B -m nvfp4_jax.train $common run_name=b2a steps=3 > $OUT/b2a_1.log 2>&1
$A -m nvfp4_jax.train $common run_name=b2a > $OUT/b2a_2.log 2>&1
$A -m nvfp4_jax.train $common run_name=a_only > $OUT/a_only.log 2>&1
$B -m nvfp4_jax.train $common run_name=b_only > $OUT/b_only.log 2>&1
echo done
