"""What a run's data and tokenizer were: the fingerprint each checkpoint records, and how two compare.

A checkpoint's config names its data only by path, and a resume reads whatever lies there now.
`fingerprint(data_config)` records what lies there: for each file the loader reads (listed with
the loader's own expansion of the config's globs, so it covers exactly what is read), its size,
a sha256 digest and, where the format knows them for free, its document and token counts; and
the tokenizer's files the same way (the byte tokenizer has a constant identity instead).

- Digest (`digest_of` says which): a file of at most `WHOLE_FILE_LIMIT` bytes (64 MiB) is hashed
  whole; a larger one by `SAMPLE_BLOCKS` blocks of `SAMPLE_BYTES` at fixed offsets (the first
  and the last block included) and its size, so a file of any size costs at most 4 MiB of reads.
  A sampled digest sees every change of size, but not an in-place edit that no block covers.
- ArrayRecord data (`prepare`'s): the index beside each file (`*.index.npz`, documents' lengths)
  is read by the loader too, so it is listed as a file of its own (hashed whole) and gives the
  data file's document and token counts.
- Counts: `text` files are bytes (tokens = size), `tokens` files tokens of `token_dtype`,
  Parquet files' rows (documents) come from their footer.

`compare(recorded, current)` lists every difference as one phrase naming the file and how it
changed. Pure functions of the files on disk; nothing here imports jax.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from typing import Any

import numpy as np

from nvfp4_jax.config import DataConfig
from nvfp4_jax.config.choices import DOCUMENT_DATASET_TYPES
from nvfp4_jax.data import documents, sources, streams
from nvfp4_jax.data.tokenizer import tokenizer_files

FORMAT = 1  # of the record; a resume compares only records of its own format
WHOLE_FILE_LIMIT = 64 << 20
SAMPLE_BLOCKS = 64
SAMPLE_BYTES = 64 << 10
WHOLE = "whole file"
SAMPLED = f"{SAMPLE_BLOCKS} blocks of {SAMPLE_BYTES} bytes at fixed offsets, and the size"
# The byte tokenizer reads no file: its identity is what it does.
BYTES_IDENTITY = "bytes (UTF-8 bytes are ids 0-255, BOS 256, EOS 257)"
_READ = 1 << 20


def digest(path: str) -> dict[str, Any]:
    """{"size", "sha256", "digest_of"} of the file `path` (whole, or sampled when large)."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE_FILE_LIMIT:
            while chunk := f.read(_READ):
                h.update(chunk)
        else:
            h.update(size.to_bytes(8, "little"))
            for i in range(SAMPLE_BLOCKS):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLE_BLOCKS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return {"size": size, "sha256": h.hexdigest(), "digest_of": WHOLE if size <= WHOLE_FILE_LIMIT else SAMPLED}


def _entry(role: str, path: str, **counts: int | None) -> dict[str, Any]:
    return {"role": role, "path": path, **digest(path), **{k: v for k, v in counts.items() if v is not None}}


def _parquet_rows(path: str) -> int | None:
    # pyarrow is optional (the `data` extra): without it the rows go uncounted
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    try:
        return int(pq.read_metadata(path).num_rows)
    except Exception:  # not a Parquet file: the loader says so
        return None


def _document_entries(role: str, files: list[str]) -> list[dict[str, Any]]:
    """The entries of a document corpus's files, with each ArrayRecord file's index beside it."""
    out = []
    for path in files:
        index = path + sources.INDEX_SUFFIX
        if path.endswith(sources.ARRAY_RECORD) and os.path.isfile(index):
            with np.load(index) as npz:
                lengths = npz["lengths"]
            out.append(_entry(role, path, documents=len(lengths), tokens=int(lengths.sum())))
            out.append(_entry(role, index))
        elif path.endswith(".parquet"):
            out.append(_entry(role, path, documents=_parquet_rows(path)))
        else:
            out.append(_entry(role, path))
    return out


def _folder_files(folder: str) -> list[str]:
    """Every file under a local dataset folder (`hf_path` alone), in sorted order."""
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names)


def data_entries(data_cfg: DataConfig) -> list[dict[str, Any]]:
    """The entries of every data file the config's `dataset_type` reads (none for synthetic)."""
    kind = data_cfg.dataset_type
    if kind == "shakespeare":
        with importlib.resources.as_file(streams.shakespeare_resource()) as real:
            return [{**_entry("train data", str(real)), "path": streams.SHAKESPEARE_FILE}]
    if kind in ("text", "tokens"):
        path = os.path.expanduser(data_cfg.dataset_path)
        itemsize = 1 if kind == "text" else np.dtype(data_cfg.token_dtype).itemsize
        return [_entry("train data", path, tokens=os.path.getsize(path) // itemsize)]
    if kind == "image_text":  # the JSONL of examples (the images it names are read at start-up)
        return [_entry("train data", os.path.expanduser(data_cfg.dataset_path))]
    if kind not in DOCUMENT_DATASET_TYPES:
        return []  # synthetic, and the digits inside scikit-learn
    train_key, train_patterns, eval_key, eval_patterns = documents.files_keys(data_cfg)
    out = []
    for role, key, patterns in (("train data", train_key, train_patterns), ("eval data", eval_key, eval_patterns)):
        if role == "eval data" and not patterns:
            continue  # the eval split is cut from the train files
        files = documents.source_files(data_cfg, key, patterns)
        if not files and os.path.isdir(data_cfg.hf_path):
            files = _folder_files(data_cfg.hf_path)
        out.extend(_document_entries(role, files))
    return out


def fingerprint(data_cfg: DataConfig) -> dict[str, Any]:
    """What the data and tokenizer of `data_cfg` are now, as JSON (a checkpoint records it).
    Raises DataError (from the loader's expansion) for a glob that matches no file."""
    tokenizer = BYTES_IDENTITY if data_cfg.tokenizer_type == "bytes" else data_cfg.tokenizer_type
    files = data_entries(data_cfg) + [_entry("tokenizer", path) for path in
                                      tokenizer_files(data_cfg.tokenizer_type, data_cfg.tokenizer_path)]
    return {"format": FORMAT, "tokenizer": tokenizer, "files": files}


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) else repr(value)


def _counts(old: dict[str, Any], new: dict[str, Any]) -> str:
    return "".join(f", {key} {_number(old[key])} -> {new[key]:,}" for key in ("documents", "tokens")
                   if key in old and key in new and old[key] != new[key])


def _file_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    where = f"{new['role']} {new['path']}"
    if old.get("size") != new["size"]:
        return f"{where}: size {_number(old.get('size'))} -> {new['size']:,} bytes{_counts(old, new)}"
    if old.get("digest_of") == new["digest_of"] and old.get("sha256") != new["sha256"]:
        return (f"{where}: content changed (same size, {new['size']:,} bytes; the sha256 of its "
                f"{new['digest_of']} differs){_counts(old, new)}")
    return None  # the same, or digested another way (another version's limits) at the same size


def compare(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per difference between a recorded fingerprint and the current one, each naming
    the file (or the tokenizer) and how it changed: size, content, no longer read, newly read."""
    diffs = []
    if recorded.get("tokenizer") != current["tokenizer"]:
        diffs.append(f"tokenizer {recorded.get('tokenizer')!r} -> {current['tokenizer']!r}")
    old = {(f.get("role"), f.get("path")): f for f in recorded.get("files", []) if isinstance(f, dict)}
    new = {(f["role"], f["path"]): f for f in current["files"]}
    for key, entry in new.items():
        if key not in old:
            diffs.append(f"{entry['role']} {entry['path']}: read now ({entry['size']:,} bytes), "
                         "not by the checkpoint's run")
        elif (change := _file_change(old[key], entry)) is not None:
            diffs.append(change)
    diffs.extend(f"{role} {path}: not read any more (it was {_number(entry.get('size'))} bytes)"
                 for (role, path), entry in old.items() if (role, path) not in new)
    return diffs
