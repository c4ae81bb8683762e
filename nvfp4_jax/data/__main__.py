"""`python -m nvfp4_jax.data prepare --input 'corpus/*.jsonl' --output data/ [--tokenizer PATH]`

Tokenizes text documents once and writes their ids as ArrayRecord, for `dataset_type=grain
grain_train_files=data/documents.array_record`:

  --input GLOB        UTF-8 text (.txt: one document per file), JSONL (one per line) or Parquet (one
                      per row); repeat the option or separate globs by commas
  --output DIR        gets documents.array_record (one record per document, int32 ids), its
                      index (documents' lengths) and nvfp4_jax_data.json (tokenizer, counts)
  --tokenizer PATH    a tokenizer.json, a SentencePiece .model or a tiktoken file (the type is
                      read from the name; --tokenizer-type overrides); without it, bytes
  --tokenizer-type T  bytes | huggingface | sentencepiece | tiktoken
  --column NAME       the text column of JSONL/Parquet rows (default: text)
  --no-bos, --no-eos  leave out BOS / EOS (both are added by default, as add_bos/add_eos)
  --overwrite         replace an existing documents.array_record
  --debug             the traceback above an `error:` line (as NVFP4_JAX_DEBUG=1)

Train with the same tokenizer keys (tokenizer_type, tokenizer_path), so that `sample` decodes
with it. Every mistake is one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from nvfp4_jax.cli import CommandParser, Exit, debug_requested, fail, parse_command
from nvfp4_jax.config.choices import TOKENIZER_TYPES
from nvfp4_jax.data import sources
from nvfp4_jax.data.errors import DataError, require
from nvfp4_jax.data.tokenizer import load_tokenizer

OUTPUT_FILE = "documents" + sources.ARRAY_RECORD


def _parser() -> CommandParser:
    parser = CommandParser("data", error=DataError)
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("--input", action="append", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--tokenizer", default="")
    parser.add_argument("--tokenizer-type", default="", choices=["", *TOKENIZER_TYPES])
    parser.add_argument("--column", default="text")
    parser.add_argument("--no-bos", action="store_true")
    parser.add_argument("--no-eos", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    return parser


def tokenizer_type_for(path: str) -> str:
    """The tokenizer type a file's name implies: bytes without a file."""
    if not path:
        return "bytes"
    if os.path.isdir(path) or path.endswith(".json"):
        return "huggingface"
    if path.endswith(".model"):
        return "sentencepiece"
    if path.endswith(".tiktoken"):
        return "tiktoken"
    raise DataError(f"--tokenizer {path!r}: cannot tell its type from the name; give --tokenizer-type "
                    f"({'|'.join(TOKENIZER_TYPES)}).")


def prepare(inputs: list[str], output: str, *, tokenizer_path: str = "", tokenizer_type: str = "",
            column: str = "text", add_bos: bool = True, add_eos: bool = True, overwrite: bool = False,
            progress: bool | None = None) -> dict:
    """Writes `output/documents.array_record` and its meta file; returns the summary it records."""
    files = sources.expand(",".join(inputs), "--input")
    kind = tokenizer_type or tokenizer_type_for(tokenizer_path)
    tokenizer = load_tokenizer(kind, tokenizer_path)
    target = os.path.join(output, OUTPUT_FILE)
    if os.path.exists(target) and not overwrite:
        raise DataError(f"{target} already exists; pass --overwrite to replace it.")
    writer_module = require("array_record.python.array_record_module", "prepare")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as exc:
        raise DataError(f"--output {output!r} cannot be created: {exc.strerror}.") from None
    # group_size:1 makes every record readable on its own (Grain reads them at random).
    writer = writer_module.ArrayRecordWriter(target + ".partial", "group_size:1")
    documents = tokens = skipped = longest = 0
    lengths: list[int] = []
    max_id = -1
    try:
        with tqdm(files, unit="file", disable=None if progress is None else not progress) as bar:
            for path in bar:
                for text in sources.read_texts(path, column):
                    ids = tokenizer.encode(text, add_bos=add_bos, add_eos=add_eos)
                    if len(ids) < 2:  # no next token to predict
                        skipped += 1
                        continue
                    writer.write(ids.astype("<i4").tobytes())
                    lengths.append(len(ids))
                    max_id = max(max_id, int(ids.max()))
                    documents, tokens, longest = documents + 1, tokens + len(ids), max(longest, len(ids))
                bar.set_postfix(documents=documents, tokens=tokens)
        writer.close()  # its last flush can fail too (a full disk)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            writer.close()
        with contextlib.suppress(OSError):
            os.remove(target + ".partial")  # a bad input or a full disk leaves nothing behind
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, DataError):
            raise DataError(f"writing {target} failed ({' '.join(str(exc).split())[:300]}); "
                            "removed the partial file.") from None
        raise
    if documents == 0:
        os.remove(target + ".partial")
        raise DataError(f"--input {', '.join(inputs)}: no document has 2 or more tokens; nothing written.")
    os.replace(target + ".partial", target)
    sources.write_index(target, np.asarray(lengths), max_id)
    summary = {
        "tokenizer": {"tokenizer_type": kind,
                      "tokenizer_path": os.path.abspath(tokenizer_path) if tokenizer_path else "", "vocab_size": tokenizer.vocab_size,
                      "add_bos": add_bos, "add_eos": add_eos},
        "inputs": files, "column": column, "documents": documents, "tokens": tokens,
        "longest_document": longest, "skipped_documents": skipped, "file": OUTPUT_FILE,
    }
    with open(os.path.join(output, sources.META_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        if (args := parse_command(_parser(), argv, __doc__)) is None:
            return Exit.OK
        summary = prepare(args.input, args.output, tokenizer_path=args.tokenizer,
                          tokenizer_type=args.tokenizer_type, column=args.column, add_bos=not args.no_bos,
                          add_eos=not args.no_eos, overwrite=args.overwrite)
    except DataError as exc:
        return fail(exc, debug=debug_requested(argv))
    tok = summary["tokenizer"]
    mean = summary["tokens"] / summary["documents"]
    print(f"prepared {summary['documents']:,} documents, {summary['tokens']:,} tokens (mean {mean:,.1f}, "
          f"longest {summary['longest_document']:,}; {summary['skipped_documents']} empty skipped) from "
          f"{len(summary['inputs'])} file(s) with tokenizer {tok['tokenizer_type']} "
          f"({tok['vocab_size']:,} ids) -> {os.path.join(args.output, OUTPUT_FILE)}")
    print(f"train with: dataset_type=grain grain_train_files={os.path.join(args.output, OUTPUT_FILE)} "
          f"tokenizer_type={tok['tokenizer_type']}"
          + (f" tokenizer_path={tok['tokenizer_path']}" if tok["tokenizer_path"] else "")
          + f" vocab_size={tok['vocab_size']} (or more)")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
