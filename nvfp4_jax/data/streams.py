"""Step-indexed windows of one token stream (the `shakespeare`, `synthetic`, `text` and `tokens`
dataset types; `documents.py` serves `grain` and `hf`).

Sources (`DataConfig.dataset_type`):
- `shakespeare`: the bundled corpus (`assets/shakespeare.txt.xz`, see `assets/SHAKESPEARE.md`),
  byte tokens.
- `synthetic`: uniform random ids in `[0, vocab_size)`, as MaxText's synthetic data (no file).
- `text`: a UTF-8 file at `dataset_path`; its bytes are the tokens (memory-mapped).
- `tokens`: a flat binary of pre-tokenized ids at `dataset_path`, dtype `token_dtype`
  (memory-mapped, never loaded whole).

Split: of a stream of N tokens, the last `int(N * eval_fraction)` tokens are `eval` and the rest
`train`. Every example is a window of `seq_len + 1` consecutive tokens lying wholly inside its
split (`inputs` = its first L tokens, `targets` = its last L), so no train example shares a token
with an eval example.

`TokenBatches.batch(step)` is a pure function of (seed, split, step): window starts are drawn by
`np.random.default_rng([seed, split_id, step])`. The data position of a run is therefore just its
step number; resuming at step n needs nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import lzma
import os

import numpy as np

from nvfp4_jax.config import DataConfig
from nvfp4_jax.config.choices import DOCUMENT_DATASET_TYPES, IMAGE_DATASET_TYPES
from nvfp4_jax.data.batches import Split, StepBatches
from nvfp4_jax.data.documents import make_document_batches
from nvfp4_jax.data.errors import DataError, check_utf8_file
from nvfp4_jax.data.image_batches import make_image_batches
from nvfp4_jax.data.image_text import image_source
from nvfp4_jax.data.packing import process_rows

BYTE_VOCAB_SIZE = 256
# The bundled corpus, inside the package.
SHAKESPEARE_FILE = "nvfp4_jax/assets/shakespeare.txt.xz"
SPLITS = {"train": 0, "eval": 1}
# Tokens per chunk when scanning a memory-mapped file for its largest id.
_SCAN_CHUNK = 1 << 24


def encode(text: str) -> np.ndarray:
    """Byte-level tokenizer: text -> uint8 ids (its UTF-8 bytes)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(ids) -> str:
    """Byte ids -> text; invalid UTF-8 becomes U+FFFD."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= BYTE_VOCAB_SIZE):
        raise ValueError(f"Byte ids must lie in [0, {BYTE_VOCAB_SIZE}); got [{ids.min()}, {ids.max()}].")
    return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=1)
def eval_boundary(total: int, eval_fraction: float) -> int:
    """Where a stream of `total` tokens splits: [0, boundary) is train, [boundary, total) eval."""
    return total - int(total * eval_fraction)


def shakespeare_resource():
    """The bundled corpus's file (xz-compressed UTF-8), as an importlib resource."""
    return importlib.resources.files("nvfp4_jax").joinpath(*SHAKESPEARE_FILE.split("/")[1:])


def shakespeare_bytes() -> bytes:
    """The bundled corpus, uncompressed (UTF-8)."""
    return lzma.decompress(shakespeare_resource().read_bytes())


@dataclasses.dataclass(frozen=True, eq=False)
class TokenBatches(Split):
    """Batches of one split. `tokens` is the whole stream (None for synthetic data) and
    `token_range` the split's `[start, stop)` inside it."""

    tokens: np.ndarray | None
    token_range: tuple[int, int]
    # Things about the data a user should hear about but that do not stop a run.
    warnings: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int | None:
        """Tokens in this split; None for synthetic data (unbounded)."""
        if self.tokens is None:
            return None
        return self.token_range[1] - self.token_range[0]

    def describe(self) -> str:
        if self.tokens is None:
            return f"{self.name} {self.split}: random ids in [0, {self.vocab_size})"
        start, stop = self.token_range
        return (f"{self.name} {self.split}: {self.num_tokens:,} tokens "
                f"([{start:,}, {stop:,}) of {len(self.tokens):,})")

    def _rng(self, step: int, *extra: int) -> np.random.Generator:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        # SeedSequence takes non-negative ints only; a negative seed maps to its 64-bit pattern.
        return np.random.default_rng([self.seed & (2**64 - 1), SPLITS[self.split], step, *extra])

    def offsets(self, step: int) -> np.ndarray:
        """int64[B]: where each example's window starts in `tokens` (not for synthetic data)."""
        if self.tokens is None:
            raise DataError("Synthetic data has no token stream and no window offsets.")
        start, stop = self.token_range
        window = self.seq_len + 1
        return start + self._rng(step).integers(0, stop - start - window + 1, size=self.global_batch_size)

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """{"inputs": int32[B/P, L], "targets": int32[B/P, L]}: this process's rows
        `[i*B/P, (i+1)*B/P)` of global batch `step`."""
        own = process_rows(self.global_batch_size, process_index, process_count)
        first, rows = own.start, len(own)
        window = self.seq_len + 1
        if self.tokens is None:
            # One generator per row, so each process draws only its own rows.
            windows_BxW = np.stack([
                self._rng(step, row).integers(0, self.vocab_size, size=window, dtype=np.int32)
                for row in range(first, first + rows)
            ])
        else:
            starts = self.offsets(step)[first:first + rows]
            windows_BxW = np.stack([self.tokens[s:s + window] for s in starts]).astype(np.int32)
        return {"inputs": windows_BxW[:, :-1], "targets": windows_BxW[:, 1:]}


def _open_file(path: str, dtype: np.dtype, kind: str) -> np.ndarray:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"dataset_type={kind!r}: dataset_path {path!r} does not exist or is not a file.")
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens "
                        f"({dtype.itemsize} bytes each); is token_dtype right?")
    if size == 0:
        return np.zeros((0,), dtype)  # np.memmap cannot map an empty file.
    return np.memmap(path, dtype=dtype, mode="r")


def _width_warning(tokens: np.ndarray, name: str) -> str | None:
    """A warning when 16-bit ids look like the halves of wider ones (every odd or every even id
    zero, the other half not): a uint32 or int32 file read with token_dtype=uint16."""
    if tokens.dtype.itemsize != 2:
        return None
    sample = np.asarray(tokens[:min(len(tokens), 1 << 20) // 2 * 2]).reshape(-1, 2)
    if len(sample) < 32:
        return None
    low_zero, high_zero = not sample[:, 0].any(), not sample[:, 1].any()
    if low_zero == high_zero:
        return None
    which = "odd" if high_zero else "even"
    return (f"{name}: every {which} token id of the first {2 * len(sample):,} is 0, as when 32-bit "
            f"ids are read as {tokens.dtype.name}; is token_dtype right (uint32 or int32)?")


def _check_ids(tokens: np.ndarray, start: int, stop: int, vocab_size: int, name: str, split: str) -> None:
    lo, hi = 0, 0
    for i in range(start, stop, _SCAN_CHUNK):
        chunk = tokens[i:min(i + _SCAN_CHUNK, stop)]
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(f"{name} ({split} split): found token id {bad}, but vocab_size={vocab_size} "
                        f"needs ids in [0, {vocab_size}).")


def make_dataset(data_cfg: DataConfig, *, seq_len: int, global_batch_size: int, seed: int, split: str,
                 vocab_size: int, image_shape: tuple[int, int, int] | None = None) -> StepBatches:
    """The batches of `split` ("train" or "eval") of the source `data_cfg` describes: a
    TokenBatches, a documents.DocumentBatches for `grain` and `hf`, or an
    image_batches.ImageTextBatches for `digits` and `image_text` (rows of `seq_len` text tokens
    beside images of `image_shape`), all `StepBatches`.

    Raises DataError for a missing file, a file whose ids do not fit `vocab_size` or a split
    shorter than one `seq_len + 1` window. `warnings` holds softer findings (ids that look like a
    wider dtype read as a narrower one).
    """
    if split not in SPLITS:
        raise DataError(f"split={split!r}: choose one of {list(SPLITS)}.")
    if seq_len < 1 or global_batch_size < 1 or vocab_size < 1:
        raise DataError(f"seq_len={seq_len}, global_batch_size={global_batch_size} and "
                        f"vocab_size={vocab_size} must all be positive.")
    kind = data_cfg.dataset_type
    if kind in DOCUMENT_DATASET_TYPES:
        return make_document_batches(data_cfg, seq_len=seq_len, global_batch_size=global_batch_size,
                                     seed=seed, split=split, vocab_size=vocab_size)
    common = dict(split=split, seq_len=seq_len, global_batch_size=global_batch_size, seed=seed,
                  vocab_size=vocab_size)
    if kind in IMAGE_DATASET_TYPES:
        if image_shape is None:
            raise DataError(f"dataset_type={kind!r} is image-text data: it feeds model_type='vlm' only.")
        name, images, examples = image_source(data_cfg)
        return make_image_batches(name, images, examples, eval_fraction=data_cfg.eval_fraction,
                                  image_shape=image_shape, **common)
    if kind == "synthetic":
        return TokenBatches(name="synthetic", tokens=None, token_range=(0, 0), **common)
    if kind == "shakespeare":
        name, tokens = "bundled shakespeare", np.frombuffer(shakespeare_bytes(), dtype=np.uint8)
    elif kind == "text":
        name, tokens = data_cfg.dataset_path, _open_file(data_cfg.dataset_path, np.dtype(np.uint8), kind)
        check_utf8_file(os.path.expanduser(data_cfg.dataset_path))  # text is UTF-8, as for `prepare`
    elif kind == "tokens":
        dtype = np.dtype(data_cfg.token_dtype)
        name, tokens = data_cfg.dataset_path, _open_file(data_cfg.dataset_path, dtype, kind)
    else:
        raise DataError(f"dataset_type={kind!r} is not one of synthetic, shakespeare, text, tokens, grain, hf, digits, image_text.")

    total = len(tokens)
    boundary = eval_boundary(total, data_cfg.eval_fraction)
    start, stop = (0, boundary) if split == "train" else (boundary, total)
    if stop - start < seq_len + 1:
        raise DataError(
            f"{name}: the {split} split has {stop - start} tokens (of {total} in all, "
            f"eval_fraction={data_cfg.eval_fraction}), but seq_len={seq_len} needs at least "
            f"{seq_len + 1} per example.")
    _check_ids(tokens, start, stop, vocab_size, name, split)
    warning = _width_warning(tokens, name)
    return TokenBatches(name=name, tokens=tokens, token_range=(start, stop),
                        warnings=(warning,) if warning else (), **common)
