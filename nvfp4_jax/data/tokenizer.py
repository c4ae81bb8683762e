"""Tokenizers with MaxText's keys: `tokenizer_type` and a local `tokenizer_path`.

- `bytes`: the UTF-8 bytes of the text are ids 0-255; BOS is 256 and EOS 257 (vocabulary 258).
- `huggingface`: a `tokenizer.json` (or a folder holding one) read by the `tokenizers` library;
  BOS/EOS are the `bos_token`/`eos_token` of a `tokenizer_config.json` beside it, else the
  first of the usual special-token names the vocabulary holds.
- `sentencepiece`: a `.model` file; BOS/EOS are the model's own (`bos_id()`, `eos_id()`).
- `tiktoken`: a tiktoken BPE file (one `base64-token rank` per line, as `cl100k_base.tiktoken`
  or Llama 3's `tokenizer.model`), split with Llama 3's pattern; BOS and EOS are appended after
  the largest rank as `<|begin_of_text|>` and `<|end_of_text|>`, as Llama 3 does.

Every library is imported only when its type is asked for. `encode` never adds special tokens
itself; `add_bos`/`add_eos` decide, the same way for every type.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from typing import Callable, Sequence

import numpy as np

from nvfp4_jax.config.choices import TOKENIZER_TYPES
from nvfp4_jax.data.errors import DataError, read_json_object, require

BYTE_BOS, BYTE_EOS = 256, 257
# Llama 3's pre-tokenizer pattern (the split applied before BPE merges).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Names under which tokenizer.json files commonly carry their BOS and EOS tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> int32 ids. `vocab_size` counts every id the tokenizer can emit."""

    kind: str
    path: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    _encode: Callable[[str], Sequence[int]]
    _decode: Callable[[list[int]], str]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
        """int32 ids of `text`, with BOS first and EOS last when asked for."""
        for wanted, special, name in ((add_bos, self.bos_id, "BOS"), (add_eos, self.eos_id, "EOS")):
            if wanted and special is None:
                raise DataError(f"tokenizer {self.path or self.kind!r} has no {name} token; set "
                                f"add_{name.lower()}=false.")
        ids = list(self._encode(text))
        return np.asarray(([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else []),
                          dtype=np.int32)

    def decode(self, ids) -> str:
        """Ids -> text; BOS and EOS are left out."""
        special = {self.bos_id, self.eos_id}
        return self._decode([int(i) for i in np.asarray(ids).reshape(-1) if int(i) not in special])

    def describe(self) -> str:
        where = f" {self.path}" if self.path else ""
        return f"tokenizer {self.kind}{where} ({self.vocab_size:,} ids, bos={self.bos_id}, eos={self.eos_id})"


def _bytes_tokenizer() -> Tokenizer:
    def encode(text: str):
        return np.frombuffer(text.encode("utf-8"), np.uint8).tolist()

    def decode(ids):
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    return Tokenizer("bytes", "", 258, BYTE_BOS, BYTE_EOS, encode, decode)


def _special_token(config: dict, key: str, where: str) -> str | None:
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(value, str):
        raise DataError(f"the tokenizer config {where}: {key} is a {type(value).__name__}, not a token "
                        "string; fix it or remove it.")
    return value


def _huggingface_paths(path: str) -> tuple[str, str]:
    """(the tokenizer.json, the tokenizer_config.json that may lie beside it) of `tokenizer_path`
    `path`, a tokenizer.json or its folder."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    return file, os.path.join(os.path.dirname(file), "tokenizer_config.json")


def tokenizer_files(tokenizer_type: str, tokenizer_path: str) -> list[str]:
    """The files `load_tokenizer` reads: none for `bytes`; for `huggingface` the tokenizer.json
    and the tokenizer_config.json beside it when there is one; else the one file."""
    if tokenizer_type == "bytes":
        return []
    path = os.path.expanduser(tokenizer_path)
    if tokenizer_type != "huggingface":
        return [path]
    file, config_path = _huggingface_paths(path)
    return [file] + ([config_path] if os.path.isfile(config_path) else [])


def _huggingface(path: str) -> Tokenizer:
    lib = require("tokenizers", "tokenizer_type='huggingface'")
    file, config_path = _huggingface_paths(path)
    try:
        tok = lib.Tokenizer.from_file(file)
    except Exception as exc:  # the library raises a bare Exception for malformed JSON
        raise DataError(f"tokenizer_path={file!r} is not a tokenizers JSON file ({exc}).") from None
    config = {}
    if os.path.isfile(config_path):
        config = read_json_object(config_path, "the tokenizer config", "fix it or remove it (BOS/EOS are "
                                  "then found by their usual names)")

    def find(key: str, names: tuple[str, ...]) -> int | None:
        named = _special_token(config, key, config_path)
        for name in ([named] if named else []) + list(names):
            token_id = tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    return Tokenizer("huggingface", file, tok.get_vocab_size(with_added_tokens=True),
                     find("bos_token", _BOS_NAMES), find("eos_token", _EOS_NAMES),
                     lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode(ids, skip_special_tokens=False))


def _sentencepiece(path: str) -> Tokenizer:
    spm = require("sentencepiece", "tokenizer_type='sentencepiece'")
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as exc:  # RuntimeError or OSError, depending on what is wrong
        raise DataError(f"tokenizer_path={path!r} is not a SentencePiece model ({exc}).") from None
    bos, eos = sp.bos_id(), sp.eos_id()
    return Tokenizer("sentencepiece", path, sp.get_piece_size(), bos if bos >= 0 else None,
                     eos if eos >= 0 else None, lambda text: sp.encode(text), lambda ids: sp.decode(ids))


def _tiktoken(path: str) -> Tokenizer:
    tiktoken = require("tiktoken", "tokenizer_type='tiktoken'")
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(f"tokenizer_path={path!r} line {number} is not 'base64-token rank': "
                                "not a tiktoken BPE file.") from None
    if not ranks:
        raise DataError(f"tokenizer_path={path!r} holds no tokens: not a tiktoken BPE file.")
    n = max(ranks.values()) + 1
    specials = {"<|begin_of_text|>": n, "<|end_of_text|>": n + 1}
    enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    return Tokenizer("tiktoken", path, n + 2, n, n + 1, enc.encode_ordinary, enc.decode)


def load_tokenizer(tokenizer_type: str, tokenizer_path: str = "") -> Tokenizer:
    """The tokenizer `tokenizer_type` names, read from `tokenizer_path` (unused for `bytes`).

    Raises DataError for an unknown type, a missing or unreadable file, or a missing library.
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"tokenizer_type={tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}.")
    if tokenizer_type == "bytes":
        return _bytes_tokenizer()
    path = os.path.expanduser(tokenizer_path)
    if not path:
        raise DataError(f"tokenizer_type={tokenizer_type!r} needs tokenizer_path=<a local file>.")
    if not os.path.exists(path):
        raise DataError(f"tokenizer_path={path!r} does not exist.")
    if tokenizer_type != "huggingface" and not os.path.isfile(path):
        raise DataError(f"tokenizer_path={path!r} is not a file.")
    return FILE_TOKENIZERS[tokenizer_type](path)


# Each tokenizer_type (config.choices) but bytes -> its reader of tokenizer_path.
FILE_TOKENIZERS = {"huggingface": _huggingface, "sentencepiece": _sentencepiece, "tiktoken": _tiktoken}


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """DataError when the model's vocabulary cannot hold every id the tokenizer emits."""
    if vocab_size < tokenizer.vocab_size:
        raise DataError(f"vocab_size={vocab_size} is smaller than the {tokenizer.describe()}; set "
                        f"vocab_size={tokenizer.vocab_size} or more.")
