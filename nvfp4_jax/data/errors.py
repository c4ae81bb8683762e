"""The one error type of the data package, and the lazy import of its optional libraries."""

from __future__ import annotations

import importlib


class DataError(ValueError):
    """A data source, tokenizer or file that cannot feed the requested batches."""


def require(module: str, what: str):
    """Imports `module` (a library of the `data` extra) or raises DataError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{what} needs the Python package {module.split('.')[0]!r}, which is not "
                        "installed: pip install 'nvfp4_jax[data]'.") from None
