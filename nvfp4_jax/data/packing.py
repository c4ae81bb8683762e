"""Documents -> rows of the batch contract, as pure functions of document lengths and ids.

A document of n token ids gives n - 1 (input, target) pairs, the target being the next token.
A document with more than `seq_len` pairs is cut into chunks of `seq_len` pairs (the last one
shorter); each chunk is a segment of its own, its positions restarting at 0.

With packing (MaxText's default) chunks fill rows in order, next fit: a chunk that does not fit
in what is left of a row starts the next one. Every row is therefore a contiguous range of the
chunk order, so a packing is just its row boundaries, and any row can be rebuilt from them
without packing the rows before it. Without packing every chunk is a row of its own. The rest of
a row is padding: id 0, segment 0, position 0, not counted in the loss.

Row keys (MaxText's): `inputs`, `targets`, `inputs_segmentation` (1, 2, ... per segment of the
row, 0 on padding), `inputs_position`, and `targets_segmentation` (equal to
`inputs_segmentation`: nonzero where the target counts).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nvfp4_jax.data.errors import DataError

BATCH_KEYS = ("inputs", "targets", "inputs_segmentation", "inputs_position", "targets_segmentation")


@dataclasses.dataclass(frozen=True)
class Chunks:
    """int64 arrays, one entry per chunk in order: its document, first token and pair count."""

    doc: np.ndarray
    start: np.ndarray
    pairs: np.ndarray


def chunk(order: np.ndarray, lengths: np.ndarray, seq_len: int) -> Chunks:
    """The chunks of documents `order` (indices into `lengths`, token counts), in that order.
    Documents of fewer than 2 tokens have no pair and no chunk."""
    pairs_D = np.maximum(lengths[order].astype(np.int64) - 1, 0)
    count_D = -(-pairs_D // seq_len)  # ceil; 0 for documents without pairs
    doc = np.repeat(order.astype(np.int64), count_D)
    # Index of each chunk within its document: 0, 1, ... restarting per document.
    first = np.cumsum(count_D) - count_D
    within = np.arange(len(doc), dtype=np.int64) - np.repeat(first, count_D)
    start = within * seq_len
    pairs = np.minimum(np.repeat(pairs_D, count_D) - start, seq_len)
    return Chunks(doc, start, pairs)


def row_bounds(pairs: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
    """int64[R + 1]: row r holds chunks [bounds[r], bounds[r + 1])."""
    if not packing:
        return np.arange(len(pairs) + 1, dtype=np.int64)
    bounds = [0]
    used = 0
    for i, n in enumerate(pairs.tolist()):
        if used + n > seq_len:
            bounds.append(i)
            used = 0
        used += n
    if len(pairs):
        bounds.append(len(pairs))
    return np.asarray(bounds, dtype=np.int64)


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
    return {key: np.zeros(seq_len, np.int32) for key in BATCH_KEYS}


def assemble_row(pieces: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """One row from the token pieces of its chunks (each `pairs + 1` ids), in order."""
    row = empty_row(seq_len)
    at = 0
    for segment, piece in enumerate(pieces, 1):
        n = len(piece) - 1
        if at + n > seq_len or n < 1:
            raise ValueError(f"a chunk of {n} pairs does not fit at {at} in a row of {seq_len}.")
        row["inputs"][at:at + n] = piece[:-1]
        row["targets"][at:at + n] = piece[1:]
        row["inputs_segmentation"][at:at + n] = segment
        row["targets_segmentation"][at:at + n] = segment
        row["inputs_position"][at:at + n] = np.arange(n, dtype=np.int32)
        at += n
    return row


def process_rows(batch_size: int, process_index: int, process_count: int) -> range:
    """The rows `[i*B/P, (i+1)*B/P)` of a global batch that process i of P builds."""
    if process_count < 1 or batch_size % process_count:
        raise DataError(f"global_batch_size={batch_size} must be divisible by process_count={process_count}.")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} must lie in [0, {process_count}).")
    rows = batch_size // process_count
    return range(process_index * rows, (process_index + 1) * rows)
