"""Hugging Face Llama safetensors <-> our parameters, one tensor at a time.

`from_hf` builds and saves one params leaf at a time (numpy, never a device), each filled in
place from its HF tensors read one at a time, so the host holds one converted leaf, its
encoded copy while orbax writes it, and one HF tensor: less than the weights once. `to_hf`
reads our params (a params checkpoint as numpy, or a run's newest intact checkpoint restored
sharded onto this process's devices) and streams safetensors files of at most
`max_shard_bytes`, one tensor on the host at a time beside the params.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import sys
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np

from nvfp4_jax.config import ConfigError, MeshConfig, ModelConfig, from_dict, make_config
from nvfp4_jax.model import lora
from nvfp4_jax.convert.hf import (
    EMBEDDING, IGNORED_SUFFIXES, LM_HEAD, ConvertError, Tensor, hf_config,
    model_keys_from_hf, param_shapes, tensors,
)
from nvfp4_jax.train import checkpoint
from nvfp4_jax.train.checkpoint import _one_line
from nvfp4_jax.train import params_checkpoint as params_lib
from nvfp4_jax.train import assembly
from nvfp4_jax.train.params_checkpoint import LAYOUT_KEYS

INDEX_FILE = "model.safetensors.index.json"
# Keys `from-hf` takes besides what config.json implies: where the arrays go in our tree.
FROM_HF_KEYS = ("model_name",) + LAYOUT_KEYS
HF_DTYPES = ("float32", "bfloat16")
# What transformers' loader accepts from a file's safetensors metadata.
_SAFETENSORS_METADATA = {"format": "pt"}


def _safetensors():
    try:
        # optional dependency (pip install safetensors)
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ConvertError("safetensors is not installed: pip install 'nvfp4_jax[hf]'") from None
    return safetensors


def _read_json(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise ConvertError(f"{path!r} does not exist: {what} needs it.")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ConvertError(f"{path!r} is not valid JSON ({' '.join(str(exc).split())}).") from None


def _empty_dir(path: str, what: str) -> None:
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConvertError(f"{what} {path!r} already exists and is not an empty directory; "
                           "give a new path.")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConvertError(f"Cannot create {what} {path!r}: {exc.strerror}.") from None


def model_config_from_hf(hf: Mapping[str, Any], overrides: Mapping[str, str] = ()) -> ModelConfig:
    """Our validated ModelConfig of an HF config.json, laid out by `overrides` (FROM_HF_KEYS)."""
    overrides = dict(overrides)
    for key in overrides:
        if key not in FROM_HF_KEYS:
            raise ConvertError(f"from-hf takes only {', '.join(FROM_HF_KEYS)} as key=value (the layout "
                               f"of the arrays); {key!r} comes from config.json or is a training key.")
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConvertError(f"config.json tie_word_embeddings={tie!r}: expected true or false.")
    try:
        return make_config(overrides, model_keys_from_hf(hf)).model
    except ConfigError as exc:
        raise ConvertError(f"config.json with the given keys is not a model this Llama can hold: {exc}") from None


def _shard_files(hf_dir: str) -> list[str]:
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path, "a sharded checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index_path!r} has no weight_map of tensor name -> file.")
        files = [os.path.join(hf_dir, f) for f in dict.fromkeys(weight_map.values())]
        for path in files:
            if not os.path.isfile(path):
                raise ConvertError(f"{index_path!r} names {os.path.basename(path)!r}, which is missing.")
        return files
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConvertError(f"{hf_dir!r} holds no *.safetensors file (pytorch_model.bin is not read: "
                           "save the model with safe_serialization).")
    return files


def _tensor_headers(files: Sequence[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) of every tensor, read from the headers only."""
    st = _safetensors()
    found: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for path in files:
        try:
            with st.safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    if name in found:
                        raise ConvertError(f"tensor {name!r} is in both {found[name][0]!r} and {path!r}.")
                    sl = f.get_slice(name)
                    found[name] = (path, tuple(sl.get_shape()), str(sl.get_dtype()))
        except ConvertError:
            raise
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise ConvertError(f"{path!r} is not a readable safetensors file ({' '.join(str(exc).split())[:200]}).") from None
    return found


def _get(tree: Mapping, path: Sequence[str]):
    for key in path:
        tree = tree[key]
    return tree


def from_hf(hf_dir: str, out_dir: str, overrides: Mapping[str, str] = ()) -> ModelConfig:
    """Converts an HF Llama folder (config.json + safetensors, sharded or not) into a params
    checkpoint at `out_dir`; returns the model it holds."""
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir!r} is not a directory (give the folder with config.json and *.safetensors).")
    hf = _read_json(os.path.join(hf_dir, "config.json"), "from-hf")
    if not isinstance(hf, dict):
        raise ConvertError(f"{os.path.join(hf_dir, 'config.json')!r} is not a JSON object.")
    m = model_config_from_hf(hf, overrides)
    headers = _tensor_headers(_shard_files(hf_dir))
    wanted = {t.hf_name: t for t in tensors(m)}
    tied = hf.get("tie_word_embeddings", False) and LM_HEAD not in headers
    lm_head = wanted[LM_HEAD]
    if tied:
        del wanted[LM_HEAD]
    for name, (path, shape, dtype) in headers.items():
        if name not in wanted and not name.endswith(IGNORED_SUFFIXES):
            raise ConvertError(f"{os.path.basename(path)} holds {name!r}, which a Llama of this "
                               "config.json does not have (biases and other architectures do not convert).")
    for name, t in wanted.items():
        if name not in headers:
            raise ConvertError(f"tensor {name!r} is missing from {hf_dir!r}"
                               + (" (tie_word_embeddings=false needs lm_head.weight)" if name == LM_HEAD else "."))
        path, shape, dtype = headers[name]
        if shape != t.hf_shape:
            raise ConvertError(f"tensor {name!r} has shape {list(shape)} but config.json implies "
                               f"{list(t.hf_shape)}.")
        if dtype not in ("F32", "BF16", "F16"):
            raise ConvertError(f"tensor {name!r} is {dtype}; only F32, BF16 and F16 convert.")
    _empty_dir(out_dir, "the output")
    # One leaf at a time: allocated, filled in place from its HF tensors (a stacked leaf from
    # every layer's, wherever its shard file is), saved, freed. leaf -> [(HF tensor, placement)]
    sources: dict[tuple[str, ...], list[tuple[str, Tensor]]] = {}
    for name, t in wanted.items():
        sources.setdefault(t.path, []).append((name, t))
    if tied:  # our LM head is its own matrix: it starts as the embedding, trains apart from it
        sources[lm_head.path] = [(EMBEDDING, lm_head)]
    st = _safetensors()
    shapes = param_shapes(m)
    checksums = {}
    for path, placements in sources.items():
        leaf = np.empty(shapes[path], np.float32)
        # The shard files are memory-mapped: a page read stays resident while its file is open,
        # so each leaf closes the files it read (kept open, they would end up holding every
        # byte of the HF checkpoint beside the leaf).
        with contextlib.ExitStack() as files:
            handles = {}
            for name, t in placements:
                file = headers[name][0]
                if file not in handles:
                    handles[file] = files.enter_context(st.safe_open(file, framework="numpy"))
                hf_array = handles[file].get_tensor(name)
                np.copyto(leaf if t.index is None else leaf[t.index], hf_array.T if t.transpose else hf_array,
                          casting="unsafe")
                del hf_array
        with _writing(out_dir):
            checksums[path] = params_lib.write_leaf(out_dir, path, leaf)
        del leaf
    with _writing(out_dir):
        params_lib.write_meta(out_dir, m, os.path.abspath(hf_dir), {p: checksums[p] for p in shapes})
    return m


@contextlib.contextmanager
def _writing(out_dir: str):
    """ConvertError (one line) for a write into the new `out_dir` that fails (a full disk, a
    permission), after removing what was written there. Orbax raises its own types (the OS
    error inside their text) and logs each failed write thread's traceback; those logs are
    dropped here, the error line says it all."""
    quiet = _DropOrbaxThreadErrors()
    logging.getLogger("absl").addFilter(quiet)
    try:
        yield
    except ConvertError:
        raise
    except Exception as exc:
        for name in os.listdir(out_dir):  # it was empty: everything in it is this conversion's
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
        raise ConvertError(f"writing the parameters checkpoint {out_dir!r} failed ({_write_failure(exc)}); "
                           "removed what was written: free the space and convert again.") from None
    finally:
        logging.getLogger("absl").removeFilter(quiet)


class _DropOrbaxThreadErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "raised an exception" not in record.getMessage()


def _write_failure(exc: BaseException) -> str:
    """The OS error behind a failed write, in words; else the exception in one line."""
    first, seen = exc, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return f"OSError: {exc.strerror}"
        code = re.search(r"os_error_code='(\d+)'", str(exc))
        if code:
            return f"OSError: {os.strerror(int(code.group(1)))}"
        exc = exc.__cause__ or exc.__context__
    return _one_line(first)


# --- to-hf ------------------------------------------------------------------------------------


def _restore_run(src: str):
    """(ModelConfig, params on this process's devices) of a run dir's newest intact checkpoint,
    or of one `<run>/checkpoints/<step>` folder, restored and verified by train.checkpoint."""
    src = os.path.abspath(src)
    step = None
    if os.path.basename(src).isdigit() and os.path.basename(os.path.dirname(src)) == "checkpoints":
        step, src = int(os.path.basename(src)), os.path.dirname(os.path.dirname(src))
    ckpt_dir = os.path.join(src, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise ConvertError(f"{src!r} is neither a run directory (with checkpoints/) nor a parameters "
                           "checkpoint (with params.json).")
    try:
        cfg = from_dict(_read_json(os.path.join(src, "config.json"), "a run directory"))
    except ConfigError as exc:
        raise ConvertError(f"{os.path.join(src, 'config.json')!r}: {exc}") from None
    # Restored on a mesh of conversion's own (all local devices, fully sharded by default),
    # whatever mesh and batch the run trained with: no training batch check applies here.
    abstract = assembly.assemble(cfg, mesh_config=MeshConfig(), check_batch=False).abstract_state
    manager = checkpoint.make_manager(ckpt_dir, max_to_keep=cfg.train.max_checkpoints_to_keep)
    try:
        if step is not None:
            state = checkpoint.restore(manager, abstract, step)[0]
        else:
            restored = checkpoint.restore_newest(
                manager, abstract, check_record=lambda s, r: None,
                on_reject=lambda s, why: print(f"warning: checkpoint step {s} in {ckpt_dir} is damaged "
                                               f"({why}); converting the next newest.", file=sys.stderr))
            if restored is None:
                raise ConvertError(f"{ckpt_dir!r} holds no checkpoint.")
            state = restored.state
    finally:
        manager.close()
    adapter = lora.from_config(cfg.model)
    if adapter is None:
        return cfg.model, state.params
    # Hugging Face's Llama has no adapters: each one is folded into its kernel, W + alpha/r A B.
    print(f"note: merged the LoRA adapters (rank {adapter.rank}, on {cfg.model.lora_targets}) into their "
          "kernels; the export is the adapted model without adapters.", file=sys.stderr)
    return cfg.model, lora.merged(state.params, adapter)


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _hf_array(params, t: Tensor, np_dtype) -> np.ndarray:
    """HF's `[out, in]` tensor `t` from our params, on the host in `np_dtype`."""
    leaf = _get(params, t.path)
    array = np.asarray(leaf if t.index is None else leaf[t.index])
    return np.ascontiguousarray((array.T if t.transpose else array).astype(np_dtype))


def _write_safetensors(path: str, planned: Sequence[Tensor], np_dtype, fetch) -> None:
    """A safetensors file written one tensor at a time: the header from the planned shapes
    (padded to 8 bytes, as the format recommends), then each tensor's bytes in that order."""
    header: dict[str, Any] = {"__metadata__": _SAFETENSORS_METADATA}
    offset = 0
    for t in planned:
        nbytes = int(np.prod(t.hf_shape)) * np_dtype.itemsize
        header[t.hf_name] = {"dtype": _SAFETENSORS_DTYPES[np_dtype.name], "shape": list(t.hf_shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with _partial(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in planned:
            array = fetch(t)
            if array.shape != t.hf_shape or array.dtype != np_dtype:
                raise ConvertError(f"tensor {t.hf_name} came out {array.dtype}{list(array.shape)}, not "
                                   f"{np_dtype}{list(t.hf_shape)}: the parameters do not match their model.")
            f.write(array.tobytes())
            del array


@contextlib.contextmanager
def _partial(path: str, mode: str = "w"):
    """A file written as `path.partial` and renamed to `path` once complete; any failure removes
    the partial file (a full disk stays no fuller), an OSError becoming one ConvertError line."""
    tmp = f"{path}.partial"
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(exc, OSError):
            raise ConvertError(f"writing {path!r} failed ({_one_line(exc)}); removed the partial file.") from None
        raise


def to_hf(src: str, out_dir: str, *, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> ModelConfig:
    """Writes `config.json` + safetensors (sharded with an index past `max_shard_bytes`) that
    `transformers.LlamaForCausalLM.from_pretrained(out_dir)` loads; returns the model written."""
    if dtype not in HF_DTYPES:
        raise ConvertError(f"--dtype={dtype!r} is not allowed: choose one of {list(HF_DTYPES)}.")
    if max_shard_bytes <= 0:
        raise ConvertError(f"--max-shard-bytes={max_shard_bytes} must be a positive number of bytes.")
    if not os.path.exists(src):
        raise ConvertError(f"{src!r} does not exist.")
    if params_lib.is_params_checkpoint(src):
        meta = params_lib.read_meta(src)
        m = make_config(meta["model"]).model
        params = params_lib.restore_numpy(src, param_shapes(m))
    else:
        m, params = _restore_run(src)
    _empty_dir(out_dir, "the output")
    np_dtype = np.dtype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    # Files planned from the shapes alone, so each can be written tensor by tensor.
    files: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors(m):
        nbytes = int(np.prod(t.hf_shape)) * np_dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for name, planned in zip(names, files):
        _write_safetensors(os.path.join(out_dir, name), planned, np_dtype,
                           lambda t: _hf_array(params, t, np_dtype))
    if len(files) > 1:
        weight_map = {t.hf_name: name for name, planned in zip(names, files) for t in planned}
        total = sum(int(np.prod(t.hf_shape)) * np_dtype.itemsize for planned in files for t in planned)
        with _partial(os.path.join(out_dir, INDEX_FILE)) as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with _partial(os.path.join(out_dir, "config.json")) as f:  # last: its presence means finished
        json.dump(hf_config(m, dtype), f, indent=2)
    return m
