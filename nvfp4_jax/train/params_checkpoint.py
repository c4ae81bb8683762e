"""Parameters-only checkpoints: what `from-hf` writes and `load_parameters_path` reads.

A folder holding `params/<leaf path>/` (one small orbax checkpoint per array of the params
tree, our layout, e.g. `params/layers.mlp.gate.kernel`) and `params.json` (the leaves, each
leaf's checksum and the model keys the arrays imply, ARCHITECTURE_KEYS and LAYOUT_KEYS). The JSON
is written last, so a folder without it is an unfinished conversion.

The checksums are the run checkpoints' (`integrity.leaf_checksum`, here computed on the host
while a leaf is written). Every reader (`restore`, `restore_numpy`) checks each restored leaf's
shape and checksum and raises ConvertError naming the first one that differs; a checkpoint
written before checksums were recorded is read with one `warning:` line.

`load_parameters_path` (MaxText's key) starts a run from these parameters with a fresh optimizer
at step 0; the run's model keys must match the recorded ones, checked before anything compiles.
It sits in `train` (below `convert`, which writes it and reads training checkpoints), with the
model keys it records and the error of an unusable input, `ConvertError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from nvfp4_jax.config import ConfigError, ModelConfig
from nvfp4_jax.model import lora
from nvfp4_jax.train import integrity
from nvfp4_jax.train.checkpoint import _one_line


class ConvertError(ValueError):
    """An input the converter cannot use; its message is one line naming the value."""


# Our model keys that fix the parameters' shapes or what they compute (the rest are numerics
# and layout policy of a run). `from-hf` records them; `load_parameters_path` checks them.
ARCHITECTURE_KEYS = (
    "vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
    "base_mlp_dim", "base_num_decoder_layers", "rope_max_timescale", "rope_scaling_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position",
    "normalization_layer_epsilon",
)
# Keys that decide where each layer's arrays sit in the tree (scanned blocks vs layers_{i}).
LAYOUT_KEYS = ("scan_layers", "bf16_first_layers", "bf16_last_layers")

FORMAT = "nvfp4_jax.params/1"
META_FILE = "params.json"
ARRAYS_DIR = "params"


def is_params_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def _leaf_dir(out_dir: str, path: tuple[str, ...]) -> str:
    return os.path.abspath(os.path.join(out_dir, ARRAYS_DIR, ".".join(path)))


def write_leaf(out_dir: str, path: tuple[str, ...], array: np.ndarray) -> list[int]:
    """Saves one params leaf as its own orbax checkpoint, so that a conversion holds one leaf at
    a time (orbax keeps every array of a save in flight, encoded, until the save ends); returns
    its checksum for `write_meta`."""
    checksum = list(integrity.host_leaf_checksum(array))
    # Orbax also copies numpy arrays before writing them unless told not to.
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as ckptr:
        ckptr.save(_leaf_dir(out_dir, path), args=ocp.args.PyTreeSave({"value": array}))
    return checksum


def write_meta(out_dir: str, m: ModelConfig, source: str, checksums: Mapping[tuple[str, ...], list[int]]) -> None:
    """`params.json`, written after every leaf (`checksums`: leaf path -> `write_leaf`'s
    answer): its presence means the conversion finished."""
    meta = {"format": FORMAT, "source": source, "leaves": [".".join(p) for p in checksums],
            "checksums": {".".join(p): list(c) for p, c in checksums.items()},
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
    if (not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("model"), dict)
            or not isinstance(meta.get("leaves"), list)):
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


def model_key_differences(saved: Mapping[str, Any], m: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved value, `m`'s value) for each recorded architecture/layout key that differs.

    Layout keys count only where they move arrays: bf16_first/last_layers only when scanned.
    """
    keys = ARCHITECTURE_KEYS + (LAYOUT_KEYS if saved.get("scan_layers") or m.scan_layers else ("scan_layers",))
    ours = dataclasses.asdict(m)
    return [(k, saved.get(k), ours[k]) for k in keys if saved.get(k) != ours[k]]


def _leaves(tree) -> list[tuple[tuple[str, ...], Any]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(tuple(str(getattr(k, "key", k)) for k in path), leaf) for path, leaf in flat]


def _nest(items) -> dict:
    tree: dict = {}
    for path, value in items:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _matching_leaves(path: str, abstract_params) -> list[tuple[tuple[str, ...], Any]]:
    """`abstract_params`' leaves, once checked to be exactly the checkpoint's, in name and shape."""
    saved = set(read_meta(path)["leaves"])
    wanted = _leaves(abstract_params)
    names = {".".join(p) for p, _ in wanted}
    if names != saved:
        raise ConvertError(f"{path!r} holds other parameters than this model's (missing "
                           f"{sorted(names - saved)[:3]}, unexpected {sorted(saved - names)[:3]}).")
    _check_shapes(path, {p: a.shape for p, a in wanted})
    return wanted


def _check_shapes(path: str, shapes: Mapping[tuple[str, ...], tuple[int, ...]]) -> None:
    """ConvertError naming the first saved array (read from its metadata alone) whose shape is
    not `shapes`'."""
    with ocp.StandardCheckpointer() as ckptr:
        for leaf_path, shape in shapes.items():
            name = ".".join(leaf_path)
            try:
                item = ckptr.metadata(_leaf_dir(path, leaf_path)).item_metadata
                saved = tuple(getattr(item, "tree", item)["value"].shape)
            except Exception as exc:  # orbax raises many types for damaged files
                raise ConvertError(f"array {name} of {path!r} cannot be read "
                                   f"({_one_line(exc)}).") from None
            if saved != tuple(shape):
                raise ConvertError(f"array {name} of {path!r} has shape {list(saved)}, but the model "
                                   f"it records needs {list(shape)}: the checkpoint is damaged.")


def _expected_checksums(path: str) -> dict[str, list[int]] | None:
    """The recorded checksums of each leaf; None, after one warning line, when the checkpoint
    was written before checksums were recorded."""
    sums = read_meta(path).get("checksums")
    if sums is None:
        if jax.process_index() == 0:
            print(f"warning: the parameters checkpoint {path!r} records no checksums (written by an "
                  "older version): its arrays are read unverified; convert it again to record them.",
                  file=sys.stderr, flush=True)
        return None
    if not isinstance(sums, dict):
        raise ConvertError(f"{os.path.join(path, META_FILE)!r} has no mapping of leaf -> checksum.")
    return sums


def _verify(path: str, name: str, got, expected: Mapping[str, list[int]] | None) -> None:
    if expected is not None and list(map(int, got)) != list(expected.get(name, ())):
        raise ConvertError(f"checksum mismatch in array {name} of {path!r}: the saved bytes changed "
                           "since the conversion (convert it again).")


def _restore_leaf(path: str, leaf_path: tuple[str, ...], read):
    try:
        return read(_leaf_dir(path, leaf_path))
    except Exception as exc:  # orbax raises many types for damaged files
        raise ConvertError(f"array {'.'.join(leaf_path)} of {path!r} cannot be read ({_one_line(exc)}).") from None


def restore(path: str, abstract_params):
    """The params onto `abstract_params`' shapes, dtypes and shardings, leaf by leaf: each
    device reads only its own shards. Verified against the recorded checksums on the devices."""
    wanted = _matching_leaves(path, abstract_params)
    expected = _expected_checksums(path)
    with ocp.StandardCheckpointer() as ckptr:
        params = _nest((p, _restore_leaf(path, p, lambda d, a=a: ckptr.restore(d, {"value": a})["value"]))
                       for p, a in wanted)
    sums, _ = integrity.inspect(params)
    for (leaf_path, _), got in zip(_leaves(params), sums.tolist()):
        _verify(path, ".".join(leaf_path), got, expected)
    return params


def restore_numpy(path: str, shapes: Mapping[tuple[str, ...], tuple[int, ...]] | None = None) -> dict:
    """The params tree as host numpy arrays (no device involved), each checked against `shapes`
    (when given: the recorded model's) and the recorded checksums."""
    names = read_meta(path)["leaves"]
    if shapes is not None:
        _check_shapes(path, shapes)
    expected = _expected_checksums(path)
    args = ocp.args.PyTreeRestore(restore_args={"value": ocp.RestoreArgs(restore_type=np.ndarray)})
    out = []
    with ocp.PyTreeCheckpointer() as ckptr:
        for name in names:
            leaf_path = tuple(name.split("."))
            array = _restore_leaf(path, leaf_path, lambda d: ckptr.restore(d, args=args)["value"])
            _verify(path, name, integrity.host_leaf_checksum(array), expected)
            out.append((leaf_path, array))
    return _nest(out)


def _is_adapter_name(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in lora.ADAPTER_LEAVES


def load_into(path: str, state, state_shardings):
    """A fresh TrainState with its params replaced by the checkpoint's (`load_parameters_path`).

    The optimizer state is the fresh one: Adam's moments start at zero whatever the params are.
    A damaged checkpoint (an array unreadable, of another shape, or not matching its checksum)
    raises ConfigError, one line naming the array.
    """
    if not path:
        return state
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            state.params, state_shardings.params)
    # A model with LoRA adapters starts from a backbone without them: the adapters keep their
    # fresh initial values (B = 0: the adapted model starts as the backbone).
    backbone, adapters = lora.split(abstract)
    try:
        fresh_adapters = bool(adapters) and not any(_is_adapter_name(n) for n in read_meta(path)["leaves"])
        wanted = backbone if fresh_adapters else abstract
        _matching_leaves(path, wanted)
        kept = lora.split(state.params)[1] if fresh_adapters else {}
        for leaf in jax.tree.leaves(lora.split(state.params)[0] if fresh_adapters else state.params):
            leaf.delete()  # never two copies of the params on the devices
        return state.replace(params=lora.join(restore(path, wanted), kept))
    except ConvertError as exc:
        raise ConfigError(f"load_parameters_path={path!r}: {exc}") from None

