"""Where documents come from: local files, read through Grain or Hugging Face `datasets`.

- ArrayRecord (`.array_record`, written by `python -m nvfp4_jax.data prepare`): one record per
  document, its token ids as little-endian int32. Read through Grain's `ArrayRecordDataSource`
  (random access). Packing is planned from the documents' lengths, which `prepare` records beside
  the file (`*.index.npz`; a file without one is read once at start-up), so a process reads only
  the documents of its own rows.
- Text (`.parquet` through Grain's pyarrow, `.jsonl`/`.json`/`.parquet`/`.arrow` through
  `datasets` in offline mode, `.txt` for `prepare`): the `train_data_columns` column of each
  row (a `.txt` file is one document), tokenized once at start-up and held in memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import io
import json
import os
from typing import Callable

import numpy as np

from nvfp4_jax.data.errors import DataError, check_utf8_file, decode_utf8, one_line, read_json_object, require
from nvfp4_jax.data.tokenizer import Tokenizer

ARRAY_RECORD = ".array_record"
# Written by `prepare` beside its ArrayRecord files: the tokenizer and counts that made them.
META_FILE = "nvfp4_jax_data.json"
# Beside each ArrayRecord file `prepare` writes: its documents' lengths, so that training reads
# only the records its rows need.
INDEX_SUFFIX = ".index.npz"
_HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True, eq=False)
class Documents:
    """N documents: their token counts, and a reader of the ids of any of them."""

    name: str
    lengths: np.ndarray  # int64[N]
    read: Callable[[list[int]], list[np.ndarray]]
    max_id: int  # the largest token id of any document (-1 when there is none)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def subset(self, indices: np.ndarray, name: str) -> Documents:
        indices = np.asarray(indices, np.int64)
        return Documents(name, self.lengths[indices], lambda docs: self.read([int(indices[i]) for i in docs]),
                         self.max_id)


def expand(patterns: str, key: str) -> list[str]:
    """Comma-separated globs -> the sorted files they match; DataError when one matches none."""
    files: list[str] = []
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        found = sorted(p for p in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(p))
        if not found:
            raise DataError(f"{key}={pattern!r} matches no file.")
        files.extend(found)
    if not files:
        raise DataError(f"{key} is empty; give one or more files or globs.")
    return list(dict.fromkeys(files))


def in_memory(name: str, docs: list[np.ndarray]) -> Documents:
    lengths = np.asarray([len(d) for d in docs], np.int64)
    flat = np.concatenate(docs).astype(np.int32) if docs else np.zeros(0, np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Documents(name, lengths, lambda idx: [flat[offsets[i]:offsets[i + 1]] for i in idx],
                     int(flat.max()) if flat.size else -1)


def tokenize(texts: list[str], tokenizer: Tokenizer, *, add_bos: bool, add_eos: bool,
             workers: int = 1) -> list[np.ndarray]:
    """Each text's ids, in order; `workers` > 1 tokenizes in threads (the libraries release the GIL)."""
    encode = lambda text: tokenizer.encode(text, add_bos=add_bos, add_eos=add_eos)  # noqa: E731
    if workers <= 1 or len(texts) < 2:
        return [encode(t) for t in texts]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(encode, texts, chunksize=64))


def _column(values, column: str, where: str) -> list[str]:
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(f"{where}: row {i} of column {column!r} is a {type(value).__name__}, not text.")
        try:  # a JSON escape such as "\\udcff" gives a lone surrogate, which is no text
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DataError(f"{where}: row {i} of column {column!r} holds the lone surrogate "
                            f"{value[exc.start]!r} at character {exc.start:,} (an escape that is not "
                            "text); text input must be UTF-8.") from None
        out.append(value)
    return out


def _missing_column(column: str, columns, where: str) -> DataError:
    return DataError(f"{where} has no column {column!r} (train_data_columns); its columns: {list(columns)}.")


def read_texts(path: str, column: str) -> list[str]:
    """The documents of one local text file: `.txt` whole, `.jsonl` lines, `.parquet` rows.

    Text must be UTF-8: invalid bytes are a DataError naming the file (or row) and byte offset."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".txt":
        with open(path, "rb") as f:
            return [decode_utf8(f.read(), path)]
    if suffix in (".jsonl", ".json"):
        texts = []
        with open(path, "rb") as f:
            text = decode_utf8(f.read(), path)
        for number, line in enumerate(io.StringIO(text, newline=None), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number} is not JSON ({exc.msg}).") from None
            if not isinstance(row, dict) or column not in row:
                keys = list(row) if isinstance(row, dict) else type(row).__name__
                raise DataError(f"{path} line {number} has no column {column!r} (train_data_columns); "
                                f"it has {keys}.")
            texts.append(row[column])
        return _column(texts, column, path)
    if suffix == ".parquet":
        return _parquet_column(path, column)
    raise DataError(f"{path}: cannot read {suffix or 'files without a suffix'}; "
                    f"text input is one of {', '.join(_TEXT_SUFFIXES)}.")


def _parquet_column(path: str, column: str) -> list[str]:
    """The `column` of a Parquet file, read row group by row group so that a damaged data page
    is named by its row group; string values are decoded here, so invalid UTF-8 names its row."""
    pa = require("pyarrow", "Parquet input")
    pq = require("pyarrow.parquet", "Parquet input")
    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
    except Exception as exc:  # pyarrow's ArrowInvalid and friends
        raise DataError(f"{path} is not a readable Parquet file ({one_line(exc)}).") from None
    if column not in names:
        raise _missing_column(column, names, path)
    texts: list = []
    with file:
        groups = file.num_row_groups
        for group in range(groups):
            try:
                values = file.read_row_group(group, columns=[column]).column(column)
            except Exception as exc:  # OSError for a damaged page (decompression, thrift, lengths)
                raise DataError(f"{path}: row group {group} (of {groups}) cannot be read ({one_line(exc)}); "
                                "the file is damaged, write it again.") from None
            if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
                first = len(texts)
                texts.extend(None if v is None else decode_utf8(v, f"{path} row {first + i:,} (column {column!r})")
                             for i, v in enumerate(values.cast(pa.large_binary()).to_pylist()))
            else:
                texts.extend(values.to_pylist())
    return _column(texts, column, path)


def _read_records(source, indices: list[int], where: str) -> list[np.ndarray]:
    out = []
    for index, record in zip(indices, source.__getitems__(indices)):
        if len(record) % 4:
            raise DataError(f"{where}: record {index} has {len(record)} bytes, not int32 token ids; "
                            "was it written by `python -m nvfp4_jax.data prepare`?")
        out.append(np.frombuffer(record, "<i4"))
    return out


def array_records(files: list[str], key: str) -> Documents:
    """Pre-tokenized documents of ArrayRecord `files` (Grain's random-access source)."""
    gp = require("grain.python", f"{key} (ArrayRecord)")
    require("array_record.python.array_record_module", f"{key} (ArrayRecord)")
    try:
        source = gp.ArrayRecordDataSource(files)
        n = len(source)
    except Exception as exc:  # array_record raises RuntimeError for a damaged file
        raise DataError(f"{key}: {', '.join(files)} is not a readable ArrayRecord file "
                        f"({' '.join(str(exc).split())}).") from None
    name = files[0] if len(files) == 1 else f"{len(files)} ArrayRecord files ({files[0]}, ...)"

    def read(indices: list[int]) -> list[np.ndarray]:
        try:
            return _read_records(source, indices, name)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"{name}: cannot read records ({' '.join(str(exc).split())}).") from None

    indexed = read_indexes(files, n)
    if indexed is not None:  # what `prepare` measured: no pass over the records but a probe
        lengths, max_id, per_file = indexed
        _probe(lengths, per_file, files, read)
        return Documents(name, lengths, read, max_id)
    lengths = np.zeros(n, np.int64)
    lo, hi = 0, -1
    for first in range(0, n, 4096):
        block = read(list(range(first, min(first + 4096, n))))
        lengths[first:first + len(block)] = [len(d) for d in block]
        for ids in block:
            if ids.size:
                lo, hi = min(lo, int(ids.min())), max(hi, int(ids.max()))
    if lo < 0:
        raise DataError(f"{name}: holds the negative token id {lo}; not written by `prepare`?")
    return Documents(name, lengths, read, hi)


def _probe(lengths: np.ndarray, per_file: list[int], files: list[str], read) -> None:
    """Reads the first and last record of every file (opening them checked their footers) and
    compares their lengths with the index: a truncated or rewritten file fails here, before
    anything compiles, at the cost of two records per file. A record damaged in the middle of a
    file is found only when a batch reads it (docs/data.md)."""
    bounds = np.cumsum([0] + per_file)
    for path, lo, hi in zip(files, bounds[:-1], bounds[1:]):
        probes = sorted({int(lo), int(hi) - 1}) if hi > lo else []
        for index, ids in zip(probes, read(probes)):
            if len(ids) != lengths[index]:
                raise DataError(f"{path}: record {index - lo} has {len(ids)} tokens, but its index says "
                                f"{lengths[index]}; re-run `python -m nvfp4_jax.data prepare ... --overwrite`.")


def write_index(path: str, lengths: np.ndarray, max_id: int) -> None:
    """`prepare`'s record of an ArrayRecord file's document lengths and largest id."""
    with open(path + INDEX_SUFFIX, "wb") as f:
        np.savez(f, lengths=np.asarray(lengths, np.int64), max_id=np.int64(max_id))


def read_indexes(files: list[str], count: int) -> tuple[np.ndarray, int, list[int]] | None:
    """(lengths, max id, records per file) of `files` from their `prepare` indexes; None when one is missing or
    they do not add up to the files' `count` records (then the records themselves are read)."""
    parts, max_id = [], -1
    for path in files:
        if not os.path.isfile(path + INDEX_SUFFIX):
            return None
        lengths, most = _read_index(path + INDEX_SUFFIX)
        parts.append(lengths)
        max_id = max(max_id, most)
    lengths = np.concatenate(parts)
    return (lengths, max_id, [len(p) for p in parts]) if len(lengths) == count else None


def _read_index(path: str) -> tuple[np.ndarray, int]:
    """(lengths, max id) of one index file; DataError when it is damaged."""
    try:
        with np.load(path, allow_pickle=False) as index:
            lengths, max_id = np.asarray(index["lengths"]), int(index["max_id"])
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
            raise ValueError(f"its lengths are {lengths.dtype}{list(lengths.shape)}, not document lengths")
    except Exception as exc:  # BadZipFile, EOFError, KeyError, ValueError, OSError, ...
        raise DataError(f"{path} is damaged ({type(exc).__name__}: {one_line(exc, 200)}); re-run "
                        "`python -m nvfp4_jax.data prepare ... --overwrite` to write it again (or delete it: "
                        "the records are then read once at start-up).") from None
    return lengths.astype(np.int64), max_id


def read_meta(directory: str) -> dict | None:
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        return None
    return read_json_object(path, "the manifest of `prepare`", "re-run `python -m nvfp4_jax.data prepare "
                            "... --overwrite` to write it again (or delete it)")


def parquet_texts(files: list[str], column: str) -> list[str]:
    texts: list[str] = []
    for path in files:
        texts.extend(read_texts(path, column))
    return texts


def hf_texts(hf_path: str, files: list[str], column: str) -> list[str]:
    """The `column` of local data loaded by `datasets` offline (nothing is downloaded): `files`
    with the builder `hf_path` (json, parquet, arrow; default from their suffix), or, without
    files, the local folder `hf_path` (a `save_to_disk` folder or one of data files)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    datasets = require("datasets", "dataset_type='hf'")
    datasets.disable_progress_bars()  # the run's own lines stay the only output
    datasets.logging.set_verbosity_error()
    where = ", ".join(files) or hf_path
    if os.path.isdir(hf_path) and not files and any(
            os.path.isfile(os.path.join(hf_path, f)) for f in ("state.json", "dataset_dict.json")):
        try:  # a folder written by Dataset.save_to_disk
            ds = datasets.load_from_disk(hf_path)
        except Exception as exc:
            raise DataError(f"hf_path={hf_path!r}: datasets could not load it ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:300]}).") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"hf_path={hf_path!r} holds the splits {list(ds)}, not 'train'.")
            ds = ds["train"]
        return _hf_column(ds, column, where)
    builder = hf_path
    if not builder:
        suffixes = {os.path.splitext(f)[1].lower() for f in files}
        if len(suffixes) != 1 or next(iter(suffixes)) not in _HF_BUILDERS:
            raise DataError(f"hf_train_files: cannot tell the format of {sorted(suffixes)}; use one of "
                            f"{', '.join(_HF_BUILDERS)} or set hf_path=json|parquet|arrow.")
        builder = _HF_BUILDERS[next(iter(suffixes))]
    if builder == "json":  # datasets' JSON reader passes invalid UTF-8 on to a crash at .to_pylist()
        for path in files:
            check_utf8_file(path)
    try:
        ds = datasets.load_dataset(builder, data_files=files or None, split="train")
    except Exception as exc:  # datasets raises many types for unreadable files
        raise DataError(f"datasets could not load {where} with hf_path={builder!r} "
                        f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}).") from None
    return _hf_column(ds, column, where)


def _hf_column(ds, column: str, where: str) -> list[str]:
    if column not in ds.column_names:
        raise _missing_column(column, ds.column_names, where)
    try:  # datasets may decode the column lazily, while _column walks it
        return _column(ds[column], column, where)
    except UnicodeDecodeError as exc:  # a string column of Parquet or Arrow files holding other bytes
        raise DataError(f"{where}: a value of column {column!r} is not UTF-8 (byte {exc.start:,} of it starts "
                        f"{exc.object[exc.start:exc.start + 4]!r}); text input must be UTF-8.") from None
