"""The one error type of the data package, and the lazy import of its optional libraries."""

from __future__ import annotations

import codecs
import importlib
import json


class DataError(ValueError):
    """A data source, tokenizer or file that cannot feed the requested batches."""


def require(module: str, what: str, extra: str = "data"):
    """Imports `module` (a library of the `extra` extra) or raises DataError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the Python package {module.split('.')[0]!r}, which is not "
                        f"installed: pip install 'nvfp4_jax[{extra}]'.") from None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most `limit` characters."""
    return " ".join(str(exc).split())[:limit]


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as text; DataError naming `where` and the byte offset of the first invalid byte.

    Text input must be UTF-8 for every tokenizer (the byte tokenizer too): nothing is replaced
    with U+FFFD, and nothing is passed through undecoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(where, exc.start, data[exc.start:exc.start + 4]) from None


def check_utf8_file(path: str, chunk: int = 1 << 24) -> None:
    """DataError (file, byte offset) unless the whole file `path` is UTF-8; reads it in chunks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # of the first byte not yet given to the decoder
    with open(path, "rb") as f:
        while True:
            data = f.read(chunk)
            pending = len(decoder.getstate()[0])  # an unfinished character from the last chunk
            try:
                decoder.decode(data, final=not data)
            except UnicodeDecodeError as exc:
                start = offset - pending + exc.start
                raise _not_utf8(path, start, exc.object[exc.start:exc.start + 4]) from None
            if not data:
                return
            offset += len(data)


def _not_utf8(where: str, offset: int, raw: bytes) -> DataError:
    return DataError(f"{where}: byte {offset:,} is not UTF-8 (it starts {raw!r}); text input must be "
                     "UTF-8 (convert it first, e.g. iconv -f latin1 -t utf-8).")


def read_json_object(path: str, what: str, fix: str) -> dict:
    """The JSON object in file `path`; DataError naming `what` it is, the file and `fix`."""
    try:
        with open(path, "rb") as f:
            value = json.loads(decode_utf8(f.read(), path))
    except OSError as exc:
        raise DataError(f"{what} {path} cannot be read ({exc.strerror}); {fix}.") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} {path} is not valid JSON (line {exc.lineno}: {exc.msg}); {fix}.") from None
    except DataError as exc:
        raise DataError(f"{what} {exc} {fix[0].upper()}{fix[1:]}.") from None
    if not isinstance(value, dict):
        raise DataError(f"{what} {path} holds a JSON {type(value).__name__}, not an object; {fix}.")
    return value
