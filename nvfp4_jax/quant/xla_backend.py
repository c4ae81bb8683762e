"""The `xla` NVFP4 backend: the recipe's three GEMMs through `jax.nn.scaled_matmul`.

`jax.nn.scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type)` is stock JAX's
block-scaled GEMM. Its contract (jax 0.10.2 `jax/_src/nn/functions.py` and
`jax/_src/cudnn/scaled_matmul_stablehlo.py`; unchanged on jax main, so 0.11): every argument is
3-D, batch first and the contraction axis last on both sides, `lhs (B, M, K)`, `rhs (B, N, K)`,
`lhs_scales (B, M, K / block)`, `rhs_scales (B, N, K / block)`, the block size inferred as
`K // scales.shape[-1]`; the result is `(B, M, N)` accumulated in fp32 and returned in
`preferred_element_type` (bf16, f16 or f32). XLA sends `float4_e2m1fn` operands with
`float8_e4m3fn` scales in 16-blocks to cuDNN's NVFP4 GEMM on Blackwell (cuDNN >= 9.7) and on
other NVIDIA GPUs rewrites the call into dequantize-then-dot with the same meaning; there is no
CPU lowering.

The operands fed to it are exactly the emulated recipe's (`nvfp4.quantize_blocks`: same codes,
same E4M3 block scales): codes become `float4_e2m1fn` (exact), laid out with the block axis,
which is always the GEMM's contraction axis, last. A 2D-scaled weight is seen from both sides:
one set of codes, its 16x16 tile scales repeated along N for FPROP (contracting K) and along K
for DGRAD (contracting N). The GEMM asks for fp32, then multiplies by alpha, the product of the
two per-tensor decode scales, in fp32 and rounds to the output dtype: the emulated GEMM's order,
so the two backends differ only by fp32 accumulation order.

`scaled_matmul` is a parameter (`xla_nvfp4_backend(scaled_matmul=...)`): the CPU tests run the
backend with `scaled_matmul_reference`, a pure-jnp transcription of the documented semantics.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import formats as F
from . import nvfp4
from .spec import OperandSpec

F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class BlockScaledOperand:
    """One NVFP4 GEMM operand in `scaled_matmul`'s layout (a JAX pytree).

    A logical 2-D operand, viewed once per axis it may be contracted along:

    codes:  per view, float4_e2m1fn `(free, K)`: the contracted axis last.
    scales: per view, float8_e4m3fn `(free, K // 16)`: the block scales of those codes.
    decode: float32 scalar, the per-tensor decode scale `amax / 2688`.
    axes:   per view, the logical axis (0 or 1) it contracts. 1x16 operands have one view
            (their block axis); a 2D-scaled weight has two, with the same codes.
    """

    codes: tuple[jax.Array, ...]
    scales: tuple[jax.Array, ...]
    decode: jax.Array
    axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))

    def view(self, axis: int) -> tuple[jax.Array, jax.Array]:
        """(codes, scales) of the view that contracts logical `axis`."""
        if axis not in self.axes:
            raise ValueError(
                f"xla GEMM: this operand was quantized in blocks along axis {self.axes[0]}, so only "
                f"that axis can be contracted; the GEMM contracts axis {axis}"
            )
        i = self.axes.index(axis)
        return self.codes[i], self.scales[i]


jax.tree_util.register_dataclass(
    BlockScaledOperand, data_fields=["codes", "scales", "decode"], meta_fields=["axes"]
)


def _check_2d(x, fn: str) -> None:
    if getattr(x, "ndim", None) != 2:
        raise ValueError(
            f"{fn}: GEMM operands are 2-D (leading dims flattened into tokens); got shape "
            f"{getattr(x, 'shape', None)}"
        )


def _operand(x: jax.Array, spec: OperandSpec, q: nvfp4.BlockCodes, fn: str) -> BlockScaledOperand:
    """The `BlockScaledOperand` of `x` from its block quantizer's result `q`."""
    # Transposes happen on float32 values, before the exact cast to float4.
    values = F.e2m1_values(q.codes).reshape(x.shape)
    if spec.two_d:
        tiles = q.scales  # (K // 16, N // 16)
        by_k = jnp.repeat(tiles.T, F.NVFP4_BLOCK, axis=0)  # (N, K // 16): FPROP contracts K
        by_n = jnp.repeat(tiles, F.NVFP4_BLOCK, axis=0)  # (K, N // 16): DGRAD contracts N
        return BlockScaledOperand((values.T.astype(F4), values.astype(F4)), (by_k, by_n), q.decode, (0, 1))
    axis = F.normalize_axis(spec.axis, 2, fn)
    scales = q.scales
    if axis == 0:
        values, scales = values.T, scales.T
    return BlockScaledOperand((values.astype(F4),), (scales,), q.decode, (axis,))


def block_scaled_operand(x: jax.Array, spec: OperandSpec, key=None, *, fn: str = "block_scaled_operand"):
    """NVFP4-quantize the 2-D GEMM operand `x` as `spec` says, into `scaled_matmul`'s form
    (`BlockScaledOperand`): the xla backend's operand quantizer."""
    _check_2d(x, fn)
    return _operand(x, spec, nvfp4.quantize_blocks(x, spec, key, fn=fn), fn)


def block_scaled_operand_group(items, *, fn: str = "block_scaled_operand_group"):
    """`[block_scaled_operand(x, spec, key) for x, spec, key in items]`, bit for bit, with the
    per-tensor factors computed together (`nvfp4.quantize_blocks_group`): the xla backend's
    `operand_group`."""
    for x, _, _ in items:
        _check_2d(x, fn)
    blocks = nvfp4.quantize_blocks_group(items, fn=fn)
    return [_operand(x, spec, q, fn) for q, (x, spec, _) in zip(blocks, items)]


def xla_operand(x: jax.Array, *, key: jax.Array | None = None, **spec_fields) -> BlockScaledOperand:
    """`block_scaled_operand` with `quantize_nvfp4`'s keyword arguments.

    The codes and scales are bitwise those of `quantize_nvfp4(x, same args)`, so
    `codes * scales * decode` equals `nvfp4_gemm_operand`'s `values * decode_scale` (transposed
    to the view's layout).
    """
    return block_scaled_operand(x, OperandSpec(**spec_fields), key, fn="xla_operand")


def scaled_matmul_reference(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """`jax.nn.scaled_matmul`'s documented semantics in plain jnp (any backend, CPU included).

    Each element times its block's scale, in fp32 (exact for E2M1 x E4M3), then
    `einsum("BMK,BNK->BMN")` accumulated in fp32, returned in `preferred_element_type`.
    """
    check_scaled_matmul_args(lhs, rhs, lhs_scales, rhs_scales)

    def dequantize(v, s):
        block = v.shape[-1] // s.shape[-1]
        return v.astype(jnp.float32) * jnp.repeat(s.astype(jnp.float32), block, axis=-1)

    out = jnp.einsum(
        "bmk,bnk->bmn", dequantize(lhs, lhs_scales), dequantize(rhs, rhs_scales),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return out.astype(preferred_element_type)


def check_scaled_matmul_args(lhs, rhs, lhs_scales, rhs_scales) -> None:
    """ValueError, naming the shapes, for arguments `scaled_matmul` cannot take as NVFP4."""
    shapes = f"lhs {lhs.shape}, rhs {rhs.shape}, lhs_scales {lhs_scales.shape}, rhs_scales {rhs_scales.shape}"
    if not all(a.ndim == 3 for a in (lhs, rhs, lhs_scales, rhs_scales)):
        raise ValueError(f"scaled_matmul takes 3-D (B, rows, K) arrays; got {shapes}")
    (b, m, k), (b2, n, k2) = lhs.shape, rhs.shape
    if (b, k) != (b2, k2):
        raise ValueError(f"scaled_matmul needs equal batch and contraction sizes; got {shapes}")
    if lhs_scales.shape[:2] != (b, m) or rhs_scales.shape[:2] != (b, n):
        raise ValueError(f"scaled_matmul scales must match their operand's (B, rows); got {shapes}")
    if lhs_scales.shape[2] != rhs_scales.shape[2] or lhs_scales.shape[2] == 0 or k % lhs_scales.shape[2]:
        raise ValueError(
            f"scaled_matmul needs one block size dividing K={k} on both sides; got {shapes}"
        )


@dataclasses.dataclass(frozen=True)
class ScaledMatmulGemm:
    """The `gemm` of the xla backend: one NVFP4 GEMM of two `BlockScaledOperand`s.

    `scaled_matmul` runs it (default `jax.nn.scaled_matmul`); frozen and compared by value, so
    two backends built alike share jit caches.
    """

    scaled_matmul: Callable = jax.nn.scaled_matmul

    def __call__(self, a: BlockScaledOperand, b: BlockScaledOperand, dimension_numbers, out_dtype):
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        if lhs_batch or rhs_batch or len(lhs_contract) != 1 or len(rhs_contract) != 1:
            raise ValueError(
                "xla GEMM: scaled_matmul contracts one axis of two 2-D operands, no batch dims; "
                f"got dimension_numbers={dimension_numbers!r}"
            )
        a_codes, a_scales = a.view(int(lhs_contract[0]))
        b_codes, b_scales = b.view(int(rhs_contract[0]))
        args = (a_codes[None], b_codes[None], a_scales[None], b_scales[None])
        check_scaled_matmul_args(*args)
        if a_codes.shape[-1] != F.NVFP4_BLOCK * a_scales.shape[-1]:
            raise ValueError(
                f"xla GEMM: NVFP4 needs blocks of {F.NVFP4_BLOCK} along K; got K={a_codes.shape[-1]} "
                f"with {a_scales.shape[-1]} scales per row"
            )
        acc = self.scaled_matmul(*args, preferred_element_type=jnp.float32)[0]
        return (acc * (a.decode * b.decode)).astype(out_dtype)


# --- does scaled_matmul lower here, and to what? -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScaledMatmulProbe:
    """What a tiny NVFP4 `scaled_matmul` did on a device.

    lowers: it compiled and ran, and matched `scaled_matmul_reference` exactly.
    fused:  the compiled HLO holds cuDNN's block-scaled GEMM (FP4 tensor cores), not XLA's
            dequantize-then-dot rewrite.
    detail: one line saying what happened (the error when it did not lower).
    """

    lowers: bool
    fused: bool
    detail: str


def cudnn_block_scaled_gemm_in(hlo_text: str) -> bool:
    """True when compiled HLO text calls cuDNN's block-scaled dot (XLA names it either as a
    cuDNN fusion of the `block_scaled_dot` composite or as `__cudnn$blockScaledDot`)."""
    return "__cudnn$blockScaledDot" in hlo_text or (
        "__cudnn$fusion" in hlo_text and "block_scaled_dot" in hlo_text
    )


def _probe_operands():
    # Codes from the whole E2M1 grid, scales 1 and 2: every product and every partial sum of the
    # 64-term dots is exact in fp32, so any accumulation order gives the reference's bits.
    rng = np.random.default_rng(0)
    grid = np.asarray(F.E2M1_VALUES, np.float32)
    lhs = grid[rng.integers(0, 16, (1, 128, 64))].astype(F4)
    rhs = grid[rng.integers(0, 16, (1, 128, 64))].astype(F4)
    scales = lambda: rng.choice(np.float32([1.0, 2.0]), (1, 128, 4)).astype(E4M3)  # noqa: E731
    return lhs, rhs, scales(), scales()


@functools.lru_cache(maxsize=None)
def _probe(device) -> ScaledMatmulProbe:
    kind = getattr(device, "device_kind", device.platform)
    where = device.platform if kind == device.platform else f"{kind} ({device.platform})"
    args = jax.device_put(_probe_operands(), device)
    try:
        compiled = jax.jit(jax.nn.scaled_matmul).lower(*args).compile()
        got = np.asarray(compiled(*args))
    except Exception as err:  # any lowering or runtime failure means "not here"
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return ScaledMatmulProbe(False, False, f"does not lower on {where}: {type(err).__name__}: {first}")
    want = np.asarray(scaled_matmul_reference(*_probe_operands()))
    if not np.array_equal(got, want):
        return ScaledMatmulProbe(False, False, f"runs on {where} but disagrees with its documented semantics")
    if cudnn_block_scaled_gemm_in(compiled.as_text()):
        return ScaledMatmulProbe(True, True, f"compiles to cuDNN's block-scaled FP4 GEMM on {where}")
    return ScaledMatmulProbe(
        True, False, f"lowers on {where} as XLA's dequantize-then-dot rewrite (no FP4 tensor cores)"
    )


def probe_scaled_matmul(device=None) -> ScaledMatmulProbe:
    """Compile and run a tiny NVFP4 `jax.nn.scaled_matmul` on `device` (default: this process's
    first local device; a global device of another process cannot run it here), once per device
    per process. Call it at start-up, never while tracing."""
    return _probe(jax.local_devices()[0] if device is None else device)
