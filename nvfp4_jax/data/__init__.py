"""Deterministic, resumable token batches: batch(step) is a pure function of the step.

- `batches.py`: the step-indexed protocol every source implements (`StepBatches`).
- `streams.py`: windows of one token stream (`shakespeare`, `synthetic`, `text`, `tokens`).
- `documents.py`: tokenized documents, packed or padded (`grain`, `hf`), with segment ids,
  positions and a loss mask (`packing.py`); read from local files (`sources.py`).
- `tokenizer.py`: `bytes`, `huggingface`, `sentencepiece`, `tiktoken`.
- `python -m nvfp4_jax.data prepare`: text/JSONL/Parquet -> ArrayRecord of token ids.

Grain, tokenizers and datasets are imported only when a config asks for them.
"""

from nvfp4_jax.data.batches import StepBatches
from nvfp4_jax.data.errors import DataError
from nvfp4_jax.data.streams import (
    BYTE_VOCAB_SIZE, SPLITS, TokenBatches, decode, encode, eval_boundary, make_dataset, shakespeare_bytes,
)
from nvfp4_jax.data.tokenizer import TOKENIZER_TYPES, Tokenizer, check_vocab, load_tokenizer

__all__ = [
    "BYTE_VOCAB_SIZE", "SPLITS", "TOKENIZER_TYPES", "DataError", "StepBatches", "TokenBatches", "Tokenizer", "check_vocab",
    "decode", "encode", "eval_boundary", "load_tokenizer", "make_dataset", "shakespeare_bytes",
]
