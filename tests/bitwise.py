"""The tests' bit-for-bit assertions, on `nvfp4_jax.bitwise` (the count the device checks and the
kernels' self-check use too). Trees must have the same structure, and every leaf pair the same
shape and dtype: a missing or extra leaf fails, it is never zipped away."""

from __future__ import annotations

from nvfp4_jax.bitwise import bits, leaf_diffs

__all__ = ["assert_same_bits", "assert_same_floats", "bits"]


def assert_same_bits(got, want, what="", *, nan_equal: bool = False):
    """Every leaf of `got` has the bits of the same leaf of `want` (`nan_equal`: NaN == NaN
    whatever the payload)."""
    bad = [f"{name}: {d} of {n} elements differ" for name, d, n in leaf_diffs(got, want, nan_equal=nan_equal) if d]
    assert not bad, f"{what}: " + "; ".join(bad) if what else "; ".join(bad)


def assert_same_floats(got, want, what=""):
    """Bitwise equal floats where NaN matches any NaN (IEEE results whose NaN payload is free)."""
    assert_same_bits(got, want, what, nan_equal=True)
