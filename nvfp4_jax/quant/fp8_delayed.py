"""Per-tensor FP8 scales: TE's delayed scaling (an amax history) and current scaling.

HYBRID format (docs/recipes.md): X and W in E4M3, the output gradient dY in E5M2.

Delayed scaling keeps, per linear layer and per tensor role (`x`, `w`, `dy`), an amax history of
`amax_history_len` steps and the scale computed from it. Step t quantizes with the stored scale,
which was computed at the end of step t-1 from amaxes of steps <= t-1: never from step t's own
tensor. The update after each step follows TE's `DelayedScaleQuantizer.update`:

1. write this step's amax into slot 0 of the history;
2. `scale = fp8_max / max(history) / 2**margin`, kept unchanged when that amax is 0 or not finite;
3. roll the history left by one and zero slot 0 (the newest amax is now the last slot).

The state is a flat dict of fp32 arrays (`FP8Meta`), `{role}_amax_history: [L]` and
`{role}_scale: [1]`. It lives in the Flax variable collection "fp8_meta" and is updated by the
overwrite-with-gradient rule: the quantized dot's custom VJP returns the *next* state as the
cotangent of the current one, so `jax.grad` with respect to the state yields the new state, and
the train step stores that instead of feeding it to the optimizer.
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp

from nvfp4_jax.quant import exact

FP8Meta = Dict[str, jax.Array]

COLLECTION = "fp8_meta"
ROLES = ("x", "w", "dy")
# HYBRID: forward tensors E4M3, gradients E5M2.
ROLE_FORMATS = {"x": "e4m3", "w": "e4m3", "dy": "e5m2"}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def history_name(role: str) -> str:
    return f"{role}_amax_history"


def scale_name(role: str) -> str:
    return f"{role}_scale"


def init_fp8_meta(amax_history_len: int = 1024) -> FP8Meta:
    """The initial delayed-scaling state of one linear layer: zero histories, unit scales."""
    meta = {}
    for role in ROLES:
        meta[history_name(role)] = jnp.zeros((amax_history_len,), jnp.float32)
        meta[scale_name(role)] = jnp.ones((1,), jnp.float32)
    return meta


def scale_from_amax(amax, fmt: str, *, margin: int = 0, fallback=None) -> jax.Array:
    """`fp8_max / amax / 2**margin` as fp32 `[1]`; `fallback` (default 1) where amax is 0 or not finite."""
    amax = jnp.reshape(jnp.asarray(amax, jnp.float32), (1,))
    fallback = jnp.ones((1,), jnp.float32) if fallback is None else fallback
    # Correctly rounded on every backend (a GPU divides only faithfully): see quant.exact.
    scale = exact.div(exact.div(FP8_MAX[fmt], amax), 2.0**margin)
    ok = (amax > 0.0) & jnp.isfinite(amax)
    return jnp.where(ok, scale, fallback)


def update_role(history: jax.Array, scale: jax.Array, amax, fmt: str, *, margin: int = 0):
    """One step of TE's delayed-scaling update for one tensor: `(next_history, next_scale)`."""
    history = history.at[0].set(jnp.asarray(amax, jnp.float32))
    next_scale = scale_from_amax(jnp.max(history), fmt, margin=margin, fallback=scale)
    next_history = jnp.roll(history, -1).at[0].set(0.0)
    return next_history, next_scale


def next_fp8_meta(meta: FP8Meta, amaxes: Dict[str, jax.Array], *, margin: int = 0) -> FP8Meta:
    """The state after a step whose tensors had the given amaxes (`{"x": ..., "w": ..., "dy": ...}`)."""
    out = {}
    for role in ROLES:
        h, s = update_role(
            meta[history_name(role)], meta[scale_name(role)], amaxes[role], ROLE_FORMATS[role],
            margin=margin,
        )
        out[history_name(role)] = h
        out[scale_name(role)] = s
    return out


def check_fp8_meta(meta, amax_history_len: int) -> None:
    """Raises ValueError unless `meta` has exactly the keys and shapes of `init_fp8_meta`."""
    want = jax.eval_shape(lambda: init_fp8_meta(amax_history_len))
    if not isinstance(meta, dict) or set(meta) != set(want):
        got = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"fp8_meta must have keys {sorted(want)}; got {got}")
    for name, spec in want.items():
        if tuple(jnp.shape(meta[name])) != spec.shape:
            raise ValueError(
                f"fp8_meta[{name!r}] has shape {tuple(jnp.shape(meta[name]))}; expected {spec.shape} "
                f"(amax_history_len={amax_history_len})"
            )
