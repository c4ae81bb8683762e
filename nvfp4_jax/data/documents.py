"""Step-indexed batches of tokenized documents (`dataset_type=grain` and `hf`).

The train split is an endless sequence of epochs. Epoch e visits every document once, in the
order `np.random.default_rng([seed, 2, e]).permutation(N)`, cut into chunks and packed into rows
(`packing.py`); epochs follow each other without a gap, and a batch that straddles two takes its
first rows from one and the rest from the next. Global batch `step` is rows
`[step * B, (step + 1) * B)` of that sequence and process i of P builds only its `B / P` of them,
reading only their documents. `batch(step)` is therefore a pure function of (files, tokenizer,
seed, step): the data position of a run is its step, which every checkpoint records, and a
resumed run sees exactly the batches the uninterrupted one saw.

The eval split is one pass in file order, unshuffled; it has `num_batches` batches, the last one
completed with padding rows that count for nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from nvfp4_jax.config import DataConfig
from nvfp4_jax.data import packing, sources
from nvfp4_jax.data.batches import Split
from nvfp4_jax.data.errors import DataError
from nvfp4_jax.data.packing import process_rows
from nvfp4_jax.data.tokenizer import check_vocab, load_tokenizer

_SHUFFLE_STREAM = 2  # beside the window streams' split ids 0 and 1


@dataclasses.dataclass(frozen=True, eq=False)
class DocumentBatches(Split):
    """Batches of one split of a document corpus, in the batch contract (`packing.BATCH_KEYS`)."""

    packing: bool
    docs: sources.Documents
    warnings: tuple[str, ...] = ()
    # Per-epoch packings and the running row count at each epoch start (derived, cached).
    _plans: dict = dataclasses.field(default_factory=dict, repr=False)
    _epoch_starts: list = dataclasses.field(default_factory=lambda: [0], repr=False)

    @property
    def shuffled(self) -> bool:
        return self.split == "train"

    @property
    def num_tokens(self) -> int:
        return self.docs.num_tokens

    def _plan(self, epoch: int) -> tuple[packing.Chunks, np.ndarray]:
        if epoch not in self._plans:
            n = len(self.docs)
            order = (np.random.default_rng([self.seed & (2**64 - 1), _SHUFFLE_STREAM, epoch]).permutation(n)
                     if self.shuffled else np.arange(n))
            chunks = packing.chunk(order, self.docs.lengths, self.seq_len)
            if len(self._plans) > 3:  # a run moves forward: old epochs are not needed again
                self._plans.pop(min(self._plans))
            self._plans[epoch] = (chunks, packing.row_bounds(chunks.pairs, self.seq_len, self.packing))
        return self._plans[epoch]

    def rows_in_epoch(self, epoch: int = 0) -> int:
        return len(self._plan(epoch)[1]) - 1

    @property
    def num_batches(self) -> int | None:
        """Batches in one pass (eval); None for the endless train split."""
        if self.shuffled:
            return None
        return -(-self.rows_in_epoch(0) // self.global_batch_size)

    def _locate(self, row: int) -> tuple[int, int]:
        """(epoch, row within it) of global row `row`."""
        starts = self._epoch_starts
        while starts[-1] <= row:
            starts.append(starts[-1] + self.rows_in_epoch(len(starts) - 1))
        epoch = int(np.searchsorted(starts, row, side="right")) - 1
        return epoch, row - starts[epoch]

    def notice(self, step: int) -> str | None:
        """A line to show when new epochs of the train split begin inside batch `step`."""
        if not self.shuffled:
            return None
        before = self._locate(step * self.global_batch_size - 1)[0] if step else 0
        last = self._locate((step + 1) * self.global_batch_size - 1)[0]
        if last == before:
            return None
        which = f"epoch {last + 1}" if last == before + 1 else f"epochs {before + 2}-{last + 1}"
        return (f"data: batch {step} starts {which} of {self.name} (every document seen {last} "
                f"time{'s' if last > 1 else ''}; reshuffled each epoch)")

    def eval_limit(self, steps: int) -> tuple[int, str | None]:
        """How many of `steps` requested eval batches exist, and a line when fewer do."""
        available = self.num_batches
        if available is None or steps <= available:
            return steps, None
        return available, (f"eval data {self.name} holds {_count(self.rows_in_epoch(0), 'row')}: "
                           f"{_count(available, 'batch', 'batches')} of {self.global_batch_size}, not "
                           f"eval_steps={steps}; evaluating on all of it (padding rows count for nothing)")

    def describe(self) -> str:
        rows = self.rows_in_epoch(0)
        counted = int(self._plan(0)[0].pairs.sum())
        fill = counted / max(rows * self.seq_len, 1)
        layout = "packed" if self.packing else "padded"
        per = (f"{rows / self.global_batch_size:,.1f} steps per epoch" if self.shuffled
               else _count(self.num_batches, "batch", "batches"))
        return (f"{self.name} {self.split}: {_count(len(self.docs), 'document')}, {self.num_tokens:,} tokens, "
                f"{layout} into {_count(rows, 'row')} of {self.seq_len} ({fill:.0%} counted; {per})")

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's rows `[i*B/P, (i+1)*B/P)` of global batch `step`: int32[B/P, L] arrays
        `inputs`, `targets`, `inputs_segmentation`, `inputs_position`, `targets_segmentation`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        own = process_rows(self.global_batch_size, process_index, process_count)
        rows = []
        for row in (step * self.global_batch_size + r for r in own):
            epoch, within = self._locate(row) if self.shuffled else (0, row)
            chunks, bounds = self._plan(epoch)
            if within >= len(bounds) - 1:  # past the end of the eval pass
                rows.append(packing.empty_row(self.seq_len))
                continue
            span = range(int(bounds[within]), int(bounds[within + 1]))
            docs = self.docs.read([int(chunks.doc[i]) for i in span])
            for d, i in zip(docs, span):
                if len(d) != self.docs.lengths[chunks.doc[i]]:
                    raise DataError(f"{self.docs.name}: document {chunks.doc[i]} has {len(d)} tokens, but "
                                    f"its index says {self.docs.lengths[chunks.doc[i]]}; prepare it again.")
            pieces = [d[chunks.start[i]:chunks.start[i] + chunks.pairs[i] + 1] for d, i in zip(docs, span)]
            rows.append(packing.assemble_row(pieces, self.seq_len))
        return {key: np.stack([r[key] for r in rows]) for key in packing.BATCH_KEYS}


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def files_keys(data_cfg: DataConfig) -> tuple[str, str, str, str]:
    """(train key, its patterns, eval key, its patterns) of a `grain` or `hf` config."""
    if data_cfg.dataset_type == "grain":
        return "grain_train_files", data_cfg.grain_train_files, "grain_eval_files", data_cfg.grain_eval_files
    return "hf_train_files", data_cfg.hf_train_files, "hf_eval_files", data_cfg.hf_eval_files


def source_files(data_cfg: DataConfig, key: str, patterns: str) -> list[str]:
    """The files the loader reads for `patterns` (of config key `key`); none for `hf_path` alone,
    which names a local dataset folder (`datasets` reads it)."""
    if data_cfg.dataset_type == "hf" and not patterns and data_cfg.hf_path:
        return []
    return sources.expand(patterns, key)


@functools.lru_cache(maxsize=4)
def _documents(data_cfg: DataConfig, key: str, patterns: str) -> sources.Documents:
    """Every document of the files `patterns` names (cached: train and eval share a read)."""
    files = source_files(data_cfg, key, patterns)
    if data_cfg.dataset_type == "hf":
        texts = sources.hf_texts(data_cfg.hf_path, files, data_cfg.train_data_columns)
    else:
        suffixes = {f.endswith(sources.ARRAY_RECORD) for f in files}
        if suffixes == {True}:
            return sources.array_records(files, key)
        if not all(f.endswith(".parquet") for f in files):
            raise DataError(f"{key}: dataset_type='grain' reads .array_record or .parquet files, not a mix or "
                            f"other kinds ({', '.join(files[:3])}).")
        texts = sources.parquet_texts(files, data_cfg.train_data_columns)
    tokenizer = load_tokenizer(data_cfg.tokenizer_type, data_cfg.tokenizer_path)
    ids = sources.tokenize(texts, tokenizer, add_bos=data_cfg.add_bos, add_eos=data_cfg.add_eos,
                           workers=data_cfg.grain_worker_count)
    name = (files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)") if files else data_cfg.hf_path
    return sources.in_memory(name, ids)


def _meta_warnings(data_cfg: DataConfig, patterns: str) -> tuple[str, ...]:
    """A warning when `prepare` recorded another tokenizer than the config names (sampling
    decodes with the config's)."""
    out = []
    for directory in dict.fromkeys(os.path.dirname(os.path.abspath(f))
                                   for f in sources.expand(patterns, "files")):
        meta = sources.read_meta(directory) or {}
        made = meta.get("tokenizer")
        made = made if isinstance(made, dict) else {}
        configured = os.path.abspath(os.path.expanduser(data_cfg.tokenizer_path)) if data_cfg.tokenizer_path else ""
        if made and (made.get("tokenizer_type"), made.get("tokenizer_path")) != (data_cfg.tokenizer_type, configured):
            out.append(f"{directory} was prepared with tokenizer_type={made.get('tokenizer_type')!r} "
                       f"tokenizer_path={made.get('tokenizer_path')!r}, but this config names "
                       f"tokenizer_type={data_cfg.tokenizer_type!r} tokenizer_path={data_cfg.tokenizer_path!r}")
    return tuple(out)


def make_document_batches(data_cfg: DataConfig, *, seq_len: int, global_batch_size: int, seed: int,
                          split: str, vocab_size: int) -> DocumentBatches:
    """The batches of `split` of a `grain` or `hf` corpus. Without eval files, the last
    `eval_fraction` of the train files' documents (at least one) is the eval split."""
    check_vocab(load_tokenizer(data_cfg.tokenizer_type, data_cfg.tokenizer_path), vocab_size)
    train_key, train_files, eval_key, eval_files = files_keys(data_cfg)
    key, patterns = (eval_key, eval_files) if split == "eval" and eval_files else (train_key, train_files)
    docs = _documents(data_cfg, key, patterns)
    if not eval_files:
        held = max(1, int(len(docs) * data_cfg.eval_fraction))
        if len(docs) < 2:
            raise DataError(f"{docs.name} holds {len(docs)} document(s): too few to hold one out for "
                            f"evaluation; give {eval_key}=... or more documents.")
        cut = len(docs) - held
        docs = (docs.subset(np.arange(cut), docs.name) if split == "train"
                else docs.subset(np.arange(cut, len(docs)), docs.name))
    if not any(docs.lengths > 1):
        raise DataError(f"{docs.name} ({split} split): no document has 2 or more tokens, so there is "
                        "nothing to predict.")
    if docs.max_id >= vocab_size:  # ArrayRecord ids come from whatever tokenizer prepared them
        raise DataError(f"{docs.name} holds token id {docs.max_id}, but vocab_size={vocab_size} needs ids "
                        f"in [0, {vocab_size}).")
    warnings = _meta_warnings(data_cfg, patterns) if data_cfg.dataset_type == "grain" else ()
    return DocumentBatches(name=docs.name, split=split, seq_len=seq_len, global_batch_size=global_batch_size,
                           seed=seed, vocab_size=vocab_size, packing=data_cfg.packing, docs=docs,
                           warnings=warnings)
