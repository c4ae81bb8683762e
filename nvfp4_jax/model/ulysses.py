"""Attention over a sequence split along its length: the two context-parallel strategies.

Shape letters as in `layers.py`; P is the size of the mesh axis the logical `activation_length`
maps to (the context axis), and every `_local` size is one device's shard.

- `ulysses` (DeepSpeed-Ulysses): each device holds `[B, L/P, H, K]` queries and `[B, L/P, G, K]`
  keys and values. One all-to-all per tensor trades the sequence split for a head split, so each
  device holds the whole sequence for `H/P` query heads and their `G/P` key/value heads; the
  kernel runs unchanged on that (causal over the row's own token order); one all-to-all trades
  the output back. Per layer and device it moves O(L * D / P) bytes. Written as an explicit
  `shard_map` so a reader (and the HLO) sees exactly two exchanges forward.
- `all_gather` (MaxText's default): queries stay split along the sequence, keys and values are
  pinned whole-sequence, so the partitioner all-gathers K and V (O(L * G * K) per device) and
  slices the causal mask for each query shard.

The kernel's own signature is kept: `fn(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs)`; a
`segment_ids_BxL` keyword (document ids, [B, L] int32) is gathered whole for the kernel.
"""

from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from nvfp4_jax.config.choices import CONTEXT_PARALLEL_STRATEGIES as STRATEGIES

# layers.BLHK (layers imports this module): q, k, v and the output, split along the sequence.
_BLHK = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
# K/V pinned whole along the sequence (the all_gather strategy).
_BMHK = ("activation_batch", None, "activation_heads", "activation_kv")


def kv_repeats(num_kv_heads: int, num_query_heads: int, ways: int) -> int:
    """How often each local KV head is repeated so that `ways` devices get whole KV groups.

    Query head h attends with KV head h // (H / G). Splitting H and G into `ways` equal,
    contiguous parts keeps every query head with its KV head when `ways` divides G; otherwise
    each KV head is repeated r times (G * r = lcm(G, ways), which divides H because `ways` and G
    both do), which keeps the grouping h -> (h // (H / (G r))) // r = h // (H / G).
    """
    if num_query_heads % ways or num_query_heads % num_kv_heads:
        raise ValueError(f"{num_query_heads} query heads cannot be split {ways} ways over "
                         f"{num_kv_heads} KV heads")
    return ways // math.gcd(num_kv_heads, ways)


def _context_axis() -> tuple[str | None, int, PartitionSpec]:
    """(mesh axis of the sequence, its size, the mesh spec of BLHK) under the ambient mesh."""
    spec = nn.logical_to_mesh_axes(_BLHK)
    mesh = jax.sharding.get_abstract_mesh()
    axis = None if spec is None else spec[1]
    if axis is None or mesh.empty or axis not in mesh.axis_names:
        return None, 1, spec
    if not isinstance(axis, str):
        raise ValueError(f"activation_length must map to one mesh axis for context parallelism, got {axis}")
    return axis, mesh.shape[axis], spec


def ulysses_attention(kernel: Callable[..., jax.Array], q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs):
    """`kernel` under Ulysses sequence parallelism (module docstring); the kernel itself when the
    sequence is not split."""
    axis, ways, spec = _context_axis()
    if ways == 1:
        return kernel(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs)
    mesh = jax.sharding.get_abstract_mesh()
    heads_axis = spec[2]
    heads_ways = 1 if heads_axis is None else math.prod(
        mesh.shape[a] for a in ((heads_axis,) if isinstance(heads_axis, str) else heads_axis))
    H_local = q_BxLxHxK.shape[2] // heads_ways
    G_local = k_BxMxGxK.shape[2] // heads_ways
    repeats = kv_repeats(G_local, H_local, ways)
    segments_spec = PartitionSpec(spec[0], axis)
    kwargs = {name: value for name, value in kwargs.items() if value is not None}  # None: the default
    names = sorted(kwargs)

    def local(q_BxLpxHlxK, k_BxLpxGlxK, v_BxLpxGlxK, *values):
        if repeats > 1:  # DeepSpeed's answer to G < P (MaxText refuses): whole groups per device
            k_BxLpxGlxK = jnp.repeat(k_BxLpxGlxK, repeats, axis=2)
            v_BxLpxGlxK = jnp.repeat(v_BxLpxGlxK, repeats, axis=2)

        def seq_to_heads(x_BxLpxNxK):  # [B, L/P, N, K] -> [B, L, N/P, K]
            return jax.lax.all_to_all(x_BxLpxNxK, axis, split_axis=2, concat_axis=1, tiled=True)

        extra = {name: jax.lax.all_gather(value, axis, axis=1, tiled=True)
                 for name, value in zip(names, values)}
        out_BxLxHpxK = kernel(seq_to_heads(q_BxLpxHlxK), seq_to_heads(k_BxLpxGlxK),
                              seq_to_heads(v_BxLpxGlxK), **extra)
        return jax.lax.all_to_all(out_BxLxHpxK, axis, split_axis=1, concat_axis=2, tiled=True)

    return jax.shard_map(
        local, in_specs=(spec, spec, spec) + (segments_spec,) * len(names), out_specs=spec,
    )(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, *(kwargs[name] for name in names))


def all_gather_attention(kernel: Callable[..., jax.Array], q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs):
    """`kernel` with queries split along the sequence and whole-sequence K/V (module docstring)."""
    k_BxMxGxK = nn.with_logical_constraint(k_BxMxGxK, _BMHK)
    v_BxMxGxK = nn.with_logical_constraint(v_BxMxGxK, _BMHK)
    return kernel(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs)


def context_parallel_attention(kernel: Callable[..., jax.Array], strategy: str) -> Callable[..., jax.Array]:
    """The attention function of `kernel` under context-parallel `strategy` (same signature)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel_strategy={strategy!r}: choose one of {list(STRATEGIES)}")
    wrapper = STRATEGY_WRAPPERS[strategy]

    def attend(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs):
        return wrapper(kernel, q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, **kwargs)

    return attend


# Each context_parallel_strategy (config.choices) -> the wrapper that runs a kernel under it.
STRATEGY_WRAPPERS = {"all_gather": all_gather_attention, "ulysses": ulysses_attention}
