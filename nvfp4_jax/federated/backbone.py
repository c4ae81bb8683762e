"""`--backbone RUN_DIR`: a federated job's initial global model, pretrained centrally.

RUN_DIR is an ordinary `python -m nvfp4_jax.train` run (e.g. `recipes/configs/vlm-tiny.yml`).
Its newest intact checkpoint's parameters are written once, before the job starts, as a
parameters checkpoint (`train/params_checkpoint.py`'s format) under the job's run directory,
and the job's `load_parameters_path` names it: the server and every site load the same
backbone (`site.initial_state`), the adapters (if any) start fresh beside it (B = 0), and under
`--update adapters|subset` the backbone never crosses the network.

`check_backbone` (jax-free, before anything starts) refuses, one line each: a folder that is not
a run directory, one without a checkpoint, a run of another model (any key that fixes the
parameters' shapes), a run with adapters of its own, and a run that held out other images than
the job does (another `seed`, `eval_fraction` or data): its training could have seen what the
server evaluates on.
"""

from __future__ import annotations

import os
import shutil
from typing import Mapping

import numpy as np

from nvfp4_jax.config import Config, ConfigError
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.train.run_dir import read_run_config

# The model keys that fix the parameters' names and shapes (the decoder's, and the VLM's towers).
SHAPE_KEYS = params_lib.ARCHITECTURE_KEYS + params_lib.LAYOUT_KEYS + (
    "model_type", "image_size", "image_channels", "patch_size", "vision_emb_dim", "vision_num_heads",
    "vision_mlp_dim", "vision_num_layers")
# The keys that decide the held-out split: the backbone's training must not have seen the job's.
SPLIT_KEYS = (("data", "dataset_type"), ("data", "dataset_path"), ("data", "eval_fraction"), ("train", "seed"))


def _steps(run_dir: str) -> list[int]:
    folder = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def check_backbone(run_dir: str, cfg: Config) -> Config:
    """The backbone run's config, once `run_dir` can start a job of `cfg`; else ConfigError."""
    where = f"--backbone {run_dir!r}"
    try:
        saved = read_run_config(run_dir)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not _steps(run_dir):
        raise ConfigError(f"{where} holds no checkpoint (checkpoints/<step>): train it first, with checkpointing on")
    diffs = [(k, getattr(saved.model, k), getattr(cfg.model, k)) for k in SHAPE_KEYS
             if getattr(saved.model, k) != getattr(cfg.model, k)]
    if diffs:
        listing = ", ".join(f"{k}={old!r} (this job: {new!r})" for k, old, new in diffs)
        raise ConfigError(f"{where} is a run of another model: {listing}")
    if saved.model.lora_rank:
        raise ConfigError(f"{where} has LoRA adapters of its own (lora_rank={saved.model.lora_rank}): "
                          "pretrain the backbone without them")
    split = [(f"{s}.{k}", getattr(getattr(saved, s), k), getattr(getattr(cfg, s), k)) for s, k in SPLIT_KEYS
             if getattr(getattr(saved, s), k) != getattr(getattr(cfg, s), k)]
    if split:
        listing = ", ".join(f"{k.split('.')[1]}={old!r} (this job: {new!r})" for k, old, new in split)
        raise ConfigError(f"{where} held out other data than this job evaluates on ({listing}): its training "
                          f"may have seen the server's held-out images; run the job with the backbone's keys")
    return saved


def write_backbone(run_dir: str, saved: Config, out_dir: str) -> int:
    """Writes the newest intact checkpoint's parameters of `run_dir` (config `saved`) to `out_dir`
    as a parameters checkpoint; returns the checkpoint's step."""
    # the trainer (model, state, checkpoints) loads only once the job is checked and starts
    from nvfp4_jax.train.run_params import newest_params

    params, step = newest_params(run_dir, saved, use="starting the federated job")
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt's leftovers
    os.makedirs(tmp)
    checksums = {}
    for path, leaf in _leaves(params):
        checksums[path] = params_lib.write_leaf(tmp, path, np.asarray(leaf))
    params_lib.write_meta(tmp, saved.model, f"{os.path.abspath(run_dir)} step {step}", checksums)
    shutil.rmtree(out_dir, ignore_errors=True)  # an earlier job's backbone in this run directory
    os.replace(tmp, out_dir)
    return step


def _leaves(tree, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value
