"""FP8 with a per-tensor scale (the FP8 baselines, spec section 10).

Transformer Engine's convention: data = saturating_cast(x * scale), x_hat = data * scale_inv
with scale_inv = 1 / scale (correctly rounded on every backend, see `exact`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import exact
from . import formats as F

FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
FP8_MAX = {"e4m3": F.E4M3_MAX, "e5m2": F.E5M2_MAX}


@dataclasses.dataclass(frozen=True)
class FP8Tensor:
    """An FP8-quantized tensor (JAX pytree).

    data: float8_e4m3fn or float8_e5m2, x's shape. scale_inv: float32 scalar, 1 / scale
    (NaN when x was not finite). amax: float32 scalar max|x| (NaN when x was not finite),
    for delayed-scaling histories.
    """

    data: jax.Array
    scale_inv: jax.Array
    amax: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_fp8(self, dtype)


jax.tree_util.register_dataclass(
    FP8Tensor, data_fields=["data", "scale_inv", "amax"], meta_fields=["fmt"]
)


def quantize_fp8(x: jax.Array, scale, fmt: str = "e4m3") -> FP8Tensor:
    """data = e4m3/e5m2(clip(fl32(x * scale), -max, max)), RNE; scale is a float32 scalar."""
    fn = "quantize_fp8"
    F.check_float(x, fn)
    if fmt not in FP8_DTYPES:
        raise ValueError(f"{fn}: fmt={fmt!r} is not supported; allowed: {sorted(FP8_DTYPES)}")
    scale = jnp.asarray(scale, jnp.float32)
    if scale.ndim != 0:
        raise ValueError(f"{fn}: scale must be a scalar; got shape {scale.shape}")
    amax_bits = jnp.max(F.abs_bits(x))
    nonfinite = F.is_nonfinite_bits(amax_bits)
    amax = jnp.where(nonfinite, jnp.float32(jnp.nan), F.bits_to_f32(amax_bits))
    data = F.saturating_cast(x.astype(jnp.float32) * scale, FP8_DTYPES[fmt])
    scale_inv = jnp.where(nonfinite, jnp.float32(jnp.nan), exact.div(1.0, scale))
    return FP8Tensor(data=data, scale_inv=scale_inv, amax=amax, fmt=fmt)


def dequantize_fp8(q: FP8Tensor, dtype=jnp.float32) -> jax.Array:
    """data * scale_inv in float32, then cast to `dtype`."""
    return (q.data.astype(jnp.float32) * q.scale_inv).astype(dtype)
