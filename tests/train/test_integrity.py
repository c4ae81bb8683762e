"""Checksums and finiteness flags: independent references, mesh independence, and sensitivity."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from nvfp4_jax.train import integrity

M32 = 2**32


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % M32
    return h ^ (h >> 16)


def _reference_checksum(a: np.ndarray) -> list[int]:
    """The documented formula with Python integers, element by element."""
    words = a.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    first = second = 0
    for i, w in enumerate(int(v) for v in words):
        first = (first + w * (2 * i + 1)) % M32
        second = (second + _fmix32(w ^ _fmix32((i + 0x9E3779B9) % M32))) % M32
    return [first, second]


ARRAYS = {
    "f32": np.random.default_rng(0).standard_normal((7, 33)).astype(np.float32),
    "bf16": np.random.default_rng(1).standard_normal((5, 16)).astype(ml_dtypes.bfloat16),
    "i32": np.arange(-50, 50, dtype=np.int32).reshape(4, 25),
    "u32": np.array([0, 1, 2**32 - 1, 12345], np.uint32),
    "scalar": np.asarray(np.float32(3.5)),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_checksum_matches_an_independent_reference(name):
    a = ARRAYS[name]
    assert np.asarray(integrity.leaf_checksum(jnp.asarray(a))).tolist() == _reference_checksum(a)


def test_checksum_does_not_depend_on_the_mesh():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32))
    tree = {"x": x, "y": x.astype(jnp.bfloat16), "n": jnp.arange(24, dtype=jnp.int32)}
    ref, _ = integrity.inspect(tree)
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 (virtual) devices")
    mesh = Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    for spec in (P("a", "b"), P(None, ("a", "b"))):
        sharded = {**tree, "x": jax.device_put(x, NamedSharding(mesh, spec)),
                   "y": jax.device_put(tree["y"], NamedSharding(mesh, spec))}
        got, _ = integrity.inspect(sharded)
        np.testing.assert_array_equal(got, ref)


def test_every_single_bit_flip_changes_the_checksum():
    a = np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32)
    checksum = jax.jit(integrity.leaf_checksum)
    base = np.asarray(checksum(jnp.asarray(a)))
    bits = a.view(np.uint32)
    rng = np.random.default_rng(4)
    for _ in range(64):
        i, bit = rng.integers(0, a.size), rng.integers(0, 32)
        flipped = bits.copy().reshape(-1)
        flipped[i] ^= np.uint32(1 << bit)
        got = np.asarray(checksum(jnp.asarray(flipped.view(np.float32).reshape(a.shape))))
        assert got[0] != base[0] and got[1] != base[1], (i, bit)
    # Swapping two elements keeps the multiset of values but not the checksum.
    swapped = a.copy().reshape(-1)
    swapped[[3, 200]] = swapped[[200, 3]]
    assert (np.asarray(checksum(jnp.asarray(swapped.reshape(a.shape)))) != base).all()


def test_finite_flags_name_the_first_bad_leaf():
    tree = {"a": jnp.ones(3), "b": {"c": jnp.array([1.0, jnp.inf]), "d": jnp.array([jnp.nan, 1.0, -2.0]),
                                    "e": jnp.array([-jnp.inf, 0.0])},
            "f": jnp.arange(3), "g": jnp.zeros((0, 4)), "h": jnp.array([3e38, -3e38], jnp.float32),
            "i": jnp.array([1.0, jnp.nan], jnp.bfloat16)}
    paths = integrity.leaf_paths(tree)
    assert paths == ["a", "b/c", "b/d", "b/e", "f", "g", "h", "i"]
    flags = jax.jit(integrity.finite_flags)(tree)
    assert np.asarray(flags).tolist() == [True, False, False, False, True, True, True, False]
    assert integrity.first_non_finite(paths, flags) == "b/c"
    assert integrity.first_non_finite(paths, [True] * 8) is None


def test_finite_flags_see_one_bad_element_anywhere_in_a_large_array():
    # Vectorised reductions split an array into lanes; a NaN in any lane must still count.
    flags = jax.jit(integrity.finite_flags)
    x = np.random.default_rng(5).standard_normal((128, 96)).astype(np.float32)
    assert np.asarray(flags([x])).tolist() == [True]
    rng = np.random.default_rng(6)
    positions = [(0, 0), (0, 1), (127, 95), (64, 17)] + [tuple(rng.integers(0, [128, 96])) for _ in range(12)]
    for bad in (np.nan, np.inf, -np.inf):
        for pos in positions:
            y = x.copy()
            y[pos] = bad
            assert np.asarray(flags([y, y.astype(ml_dtypes.bfloat16)])).tolist() == [False, False], (bad, pos)
