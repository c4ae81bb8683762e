"""Parameters-only checkpoints: what `from-hf` writes and `load_parameters_path` reads.

A folder holding `params/` (an orbax checkpoint of the params tree, our layout) and
`params.json` (the model keys the arrays imply, ARCHITECTURE_KEYS and LAYOUT_KEYS). The JSON is
written last, so a folder without it is an unfinished conversion.

`load_parameters_path` (MaxText's key) starts a run from these parameters with a fresh optimizer
at step 0; the run's model keys must match the recorded ones, checked before anything compiles.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from nvfp4_jax.config import ConfigError, ModelConfig
from nvfp4_jax.convert.hf import (
    ARCHITECTURE_KEYS, LAYOUT_KEYS, ConvertError, model_key_differences,
)

FORMAT = "nvfp4_jax.params/1"
META_FILE = "params.json"
ARRAYS_DIR = "params"


def is_params_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def write(out_dir: str, params: dict, m: ModelConfig, source: str) -> None:
    """Saves the params tree (numpy or jax arrays) and then its `params.json`."""
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.path.abspath(os.path.join(out_dir, ARRAYS_DIR)), params)
    ckptr.wait_until_finished()
    ckptr.close()
    meta = {"format": FORMAT, "source": source,
            "model": {k: getattr(m, k) for k in ARCHITECTURE_KEYS + LAYOUT_KEYS}}
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)


def read_meta(path: str) -> dict[str, Any]:
    """`params.json` of a params checkpoint; ConvertError (one line) for anything else."""
    if not os.path.isdir(path):
        raise ConvertError(f"{path!r} does not exist or is not a directory.")
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise ConvertError(f"{path!r} has no {META_FILE}: it is not a parameters checkpoint written "
                           "by `python -m nvfp4_jax.convert from-hf` (or the conversion did not finish).")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConvertError(f"{meta_path!r} cannot be read as JSON ({exc}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("model"), dict):
        raise ConvertError(f"{meta_path!r} is not a {FORMAT} record.")
    if not os.path.isdir(os.path.join(path, ARRAYS_DIR)):
        raise ConvertError(f"{path!r} has {META_FILE} but no {ARRAYS_DIR}/ folder of arrays.")
    return meta


def check_load_path(path: str, m: ModelConfig) -> None:
    """ConfigError (one line) when `load_parameters_path=path` cannot start a run of `m`."""
    if not path:
        return
    try:
        meta = read_meta(path)
    except ConvertError as exc:
        raise ConfigError(f"load_parameters_path={path!r}: {exc}") from None
    diffs = model_key_differences(meta["model"], m)
    if diffs:
        listing = ", ".join(f"{k}={old!r} (this run: {new!r})" for k, old, new in diffs)
        fix = " ".join(f"{k}={str(old).lower() if isinstance(old, bool) else old}" for k, old, _ in diffs)
        raise ConfigError(f"load_parameters_path={path!r} holds parameters of another model: {listing}; "
                          f"run with {fix}.")


def restore(path: str, abstract_params):
    """The params onto `abstract_params`' shapes, dtypes and shardings: each device reads only
    its own shards."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(os.path.join(path, ARRAYS_DIR)), abstract_params)


def restore_numpy(path: str) -> dict:
    """The params tree as host numpy arrays (no device involved)."""
    import jax
    import orbax.checkpoint as ocp

    directory = os.path.abspath(os.path.join(path, ARRAYS_DIR))
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(directory)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return ckptr.restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))


def load_into(path: str, state, state_shardings):
    """A fresh TrainState with its params replaced by the checkpoint's (`load_parameters_path`).

    The optimizer state is the fresh one: Adam's moments start at zero whatever the params are.
    """
    if not path:
        return state
    import jax

    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            state.params, state_shardings.params)
    return state.replace(params=restore(path, abstract))
