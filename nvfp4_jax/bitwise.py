"""Bit-for-bit comparison of pytrees of arrays: the one implementation that the kernels'
self-check, the device checks and the tests (tests/bitwise.py) count differing bits with.

Two trees compare only when they have the same structure and every pair of leaves the same
shape and dtype; anything else is a `BitMismatch`, never a silent pass (zipping the leaves
would let a missing leaf through).
"""

from __future__ import annotations

import jax
import numpy as np


class BitMismatch(ValueError):
    """The two trees cannot be compared element by element (structure, shape or dtype)."""


def bits(a) -> np.ndarray:
    """`a` as unsigned integers of its own width (floats, ml_dtypes floats and ints alike)."""
    a = np.asarray(a)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(f"u{a.dtype.itemsize}")


def leaf_diffs(got, want, *, nan_equal: bool = False) -> list[tuple[str, int, int]]:
    """[(leaf path, differing elements, elements)] for every leaf pair of `got` and `want`.

    `nan_equal`: any NaN matches any NaN (for results whose NaN payload is not specified)."""
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    if got_def != want_def:
        raise BitMismatch(f"tree structures differ: {got_def} vs {want_def}")
    out = []
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            raise BitMismatch(f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
        differ = bits(g) != bits(w)
        if nan_equal and (g.dtype.kind == "f" or "float" in g.dtype.name):  # ml_dtypes: kind "V"
            gn, wn = np.isnan(g.astype(np.float32)), np.isnan(w.astype(np.float32))
            differ = np.where(gn & wn, False, differ)
        out.append((name, int(differ.sum()), int(g.size)))
    return out


def bit_diff(got, want, *, nan_equal: bool = False) -> int:
    """How many elements differ in their bits between two trees of arrays (see `leaf_diffs`)."""
    return sum(d for _, d, _ in leaf_diffs(got, want, nan_equal=nan_equal))
