"""Checkpoints in and out of Hugging Face Llama (`python -m nvfp4_jax.convert --help`).

`hf` is the one map between the two models (config fields, tensor names, transposes);
`checkpoints` the streaming conversions into and out of the parameters-only checkpoint that
`load_parameters_path` reads (`nvfp4_jax.train.params_checkpoint`).
"""
