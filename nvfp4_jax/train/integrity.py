"""Cheap on-device facts about a pytree of arrays (the TrainState): which leaves are finite, and a
checksum of every leaf's bits.

Both are reductions computed where the arrays live, inside `jit`, so they cost one read of the
state and never move it to the host. The checksum is a sum modulo 2**32, which is associative and
commutative: it does not depend on how a leaf is sharded or in which order devices reduce, so a
checkpoint saved on one mesh verifies on another.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_UINT_OF_ITEMSIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(tree: Any) -> list[str]:
    """'params/layers_0/mlp/gate/kernel'-style names of the leaves, in `jax.tree.leaves` order."""
    return ["/".join(_key_name(e) for e in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def finite_flags(tree: Any) -> jax.Array:
    """bool[num_leaves]: whether every element of each leaf is finite (non-float leaves: True).

    Meant to be traced inside the train step, so the check rides along with the step's metrics.
    """
    # sum(x * 0) is 0 when every element is finite and NaN otherwise (0 * inf = NaN, and a sum
    # always propagates NaN, however it is vectorised; a max need not). A float sum vectorises
    # where an all() over booleans does not: several times cheaper on CPU.
    flags = [
        jnp.isfinite(jnp.sum(x * jnp.zeros((), x.dtype), dtype=jnp.float32))
        if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.asarray(True)
        for x in jax.tree.leaves(tree)
    ]
    return jnp.stack(flags) if flags else jnp.zeros((0,), bool)


def _fmix32(h: jax.Array) -> jax.Array:
    # MurmurHash3's 32-bit finaliser: every input bit affects every output bit.
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits_u32(x: jax.Array) -> jax.Array:
    if x.dtype.itemsize == 8:  # 64-bit leaves: fold both halves into one word
        halves = jax.lax.bitcast_convert_type(x, jnp.uint32)
        return halves[..., 0] ^ _fmix32(halves[..., 1])
    unsigned = jax.lax.bitcast_convert_type(x, _UINT_OF_ITEMSIZE[x.dtype.itemsize])
    return unsigned.astype(jnp.uint32)


def _linear_index(shape: tuple[int, ...]) -> jax.Array:
    # Built from broadcasted iotas rather than a reshape, so a sharded leaf is never gathered.
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32[2] of one array's bits and shape-order.

    The first word is sum(bits * (2i + 1)): the multiplier is odd, hence invertible modulo 2**32,
    so changing any single element always changes it. The second mixes bits and position through
    a hash, so that swaps and multi-element changes do not cancel in both words at once.
    """
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.zeros((2,), jnp.uint32)
    bits = _bits_u32(x)
    index = _linear_index(x.shape)
    first = jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
    second = jnp.sum(_fmix32(bits ^ _fmix32(index + jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)
    return jnp.stack([first, second])


def checksums(tree: Any) -> jax.Array:
    """uint32[num_leaves, 2]: `leaf_checksum` of every leaf, in `jax.tree.leaves` order."""
    sums = [leaf_checksum(x) for x in jax.tree.leaves(tree)]
    return jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)


def _replicated_on(tree: Any):
    for leaf in jax.tree.leaves(tree):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return NamedSharding(leaf.sharding.mesh, PartitionSpec())
    return None


def _summaries(tree: Any):
    return checksums(tree), finite_flags(tree)


@functools.lru_cache(maxsize=8)
def _jitted_summaries(out_sharding):
    return jax.jit(_summaries, **({"out_shardings": out_sharding} if out_sharding is not None else {}))


def inspect(tree: Any) -> tuple[np.ndarray, np.ndarray]:
    """(checksums uint32[n, 2], finite flags bool[n]) of `tree`, computed on device, on the host.

    The results are replicated, so every process of a multi-host run gets the same answer.
    """
    sums, flags = jax.device_get(_jitted_summaries(_replicated_on(tree))(tree))
    return np.asarray(sums), np.asarray(flags)


def first_non_finite(paths: list[str], flags) -> str | None:
    """The path of the first leaf whose flag is False, or None when all are finite."""
    for path, ok in zip(paths, np.asarray(flags).tolist()):
        if not ok:
            return path
    return None


# --- the same checksum on the host, for arrays that never reach a device -----------------------

_NP_UINT_OF_ITEMSIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_HOST_CHUNK = 1 << 20  # elements per step: the temporaries stay a few MiB whatever the array


def _np_fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _np_bits_u32(flat: np.ndarray) -> np.ndarray:
    if flat.dtype.itemsize == 8:
        halves = flat.view(np.uint32).reshape(-1, 2)  # little-endian: the low word first, as jax
        return halves[:, 0] ^ _np_fmix32(halves[:, 1])
    return flat.view(_NP_UINT_OF_ITEMSIZE[flat.dtype.itemsize]).astype(np.uint32)


def host_leaf_checksum(x) -> tuple[int, int]:
    """`leaf_checksum` of a host (numpy) array, computed with numpy in chunks: the same two
    words, without a device or a full-size temporary (converted leaves stay on the host)."""
    flat = np.ascontiguousarray(x).reshape(-1)
    first = second = np.uint32(0)
    with np.errstate(over="ignore"):  # uint32 arithmetic is meant to wrap modulo 2**32
        for start in range(0, flat.size, _HOST_CHUNK):
            bits = _np_bits_u32(flat[start:start + _HOST_CHUNK])
            index = np.arange(start, start + bits.size, dtype=np.uint64).astype(np.uint32)
            first += np.sum(bits * (index * np.uint32(2) + np.uint32(1)), dtype=np.uint32)
            second += np.sum(_np_fmix32(bits ^ _np_fmix32(index + np.uint32(0x9E3779B9))), dtype=np.uint32)
    return int(first), int(second)
