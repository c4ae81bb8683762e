"""Which quantizer computes the NVFP4 GEMM operands of a run: the `quant_kernels` config key.

    auto    the Pallas kernels on a single NVIDIA GPU when their start-up self-check (kernels
            vs the jnp reference, bit for bit, on a small tensor) passes; jnp elsewhere
    pallas  the Pallas kernels (compiled with Triton on a GPU; in Pallas's interpreter
            elsewhere: bit-exact, slow, for tests)
    jnp     the jnp reference (`nvfp4_jax.quant.nvfp4_gemm_operand`)

`operand_kernels(choice)` returns the operand functions and the reason, which the run prints at
start-up; `with_operand_kernels(backend, kernels)` puts them into any `NVFP4Backend` whose GEMM
consumes the emulated operand form (bf16 values, fp32 decode scale).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.bitwise import bit_diff
from nvfp4_jax.quant import nvfp4
from nvfp4_jax.quant.nvfp4_backend import NVFP4Backend
from nvfp4_jax.quant.recipe import QUANT_KERNELS
from nvfp4_jax.kernels import operand
from nvfp4_jax.kernels.quantize import Copy, fused_quantize


@dataclasses.dataclass(frozen=True)
class OperandKernels:
    """The chosen operand quantizer: `operand` and `operand_pair` as `NVFP4Backend` takes them."""

    name: str  # "pallas" or "jnp"
    reason: str
    operand: Callable
    operand_pair: Optional[Callable] = None


JNP = "jnp"
PALLAS = "pallas"

# Every copy the quantized GEMM asks of the kernels, in operand form, and the reference's
# arguments for each (the self-check compares them).
SELF_CHECK_COPIES = (
    (Copy("rows"), dict(axis=1)),
    (Copy("rows", stochastic=True), dict(axis=1, stochastic=True)),
    (Copy("tiles"), dict(two_d=True)),
    (Copy("cols"), dict(axis=0)),
    (Copy("cols", rht=True), dict(axis=0, rht=True)),
    (Copy("cols", rht=True, stochastic=True), dict(axis=0, rht=True, stochastic=True)),
)


def self_check_data() -> np.ndarray:
    """A small bf16-exact tensor with what trips a quantizer: a wide dynamic range (normal,
    subnormal and underflowing E4M3 block scales), zero blocks and 16x16 tiles, E2M1 ties."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((64, 128)) * np.exp(3 * rng.standard_normal((64, 8, 1))).repeat(16, 2).reshape(64, 128)
    x[:16, :16] = 0.0
    x[16:18, :] = rng.choice([0.25, 0.75, 1.25, 2.5, 5.0, -3.5], (2, 128)) * 2.0**-9
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@functools.lru_cache(maxsize=None)  # compiled once per copy set (and input shape and dtype)
def _fused_jit(copies: tuple, tile, interpret: bool, fused: Callable):
    kw = dict(interpret=interpret) if tile is None else dict(interpret=interpret, tile=tile)
    return jax.jit(lambda x, keys: fused(x, list(copies), list(keys), **kw))


@functools.lru_cache(maxsize=None)
def _reference_jit(kw_items: tuple, packed: bool):
    fn = nvfp4.quantize_nvfp4 if packed else nvfp4.nvfp4_gemm_operand
    return jax.jit(lambda x, key: fn(x, **dict(kw_items), key=key))


def _storage(q) -> tuple:
    return (q.codes, q.scales, q.amax)


def kernels_vs_reference(x, copies, keys, *, interpret: bool, tile=None,
                         fused: Callable = fused_quantize) -> list[int]:
    """The kernels' one fused call for every `(Copy, reference kwargs)` in `copies` against the
    jnp reference with the same kwargs and key: for each copy, how many elements' bits differ
    (operand form: values and decode scale vs `nvfp4_gemm_operand`; packed form: codes, scale
    bytes and amax vs `quantize_nvfp4`). `keys[i]` is copy i's SR key (None when not stochastic).

    The one kernel-vs-reference comparison: the start-up self-check, the device checks and the
    kernel tests all count with it (`nvfp4_jax.bitwise.bit_diff`: shapes and dtypes must match)."""
    keys = [k if c.stochastic else None for (c, _), k in zip(copies, keys, strict=True)]
    got = _fused_jit(tuple(c for c, _ in copies), tile, interpret, fused)(x, keys)
    diffs = []
    for (copy, kw), key, result in zip(copies, keys, got, strict=True):
        want = _reference_jit(tuple(sorted(kw.items())), copy.packed)(x, key)
        if copy.packed:
            result, want = _storage(result), _storage(want)
        diffs.append(bit_diff(result, want))
    return diffs


def self_check(*, interpret: bool = False, fused: Callable = fused_quantize) -> tuple[bool, str]:
    """(ok, message): the kernels (`fused`, in one call) against `nvfp4_gemm_operand` on
    `self_check_data()` in bf16, bitwise: values and decode scales of every copy in
    `SELF_CHECK_COPIES`. A crash (e.g. a kernel that does not compile) is a failed check."""
    x = jnp.asarray(self_check_data(), jnp.bfloat16)
    key = jax.random.key(2024)
    try:
        keys = [jax.random.fold_in(key, i) for i in range(len(SELF_CHECK_COPIES))]
        diffs = kernels_vs_reference(x, SELF_CHECK_COPIES, keys, interpret=interpret, fused=fused)
        bad = [f"{kw}: {d} values differ" for (_, kw), d in zip(SELF_CHECK_COPIES, diffs) if d]
    except Exception as exc:  # noqa: BLE001 - any failure means "do not use the kernels"
        return False, f"the kernels failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if bad:
        return False, "the kernels differ from the jnp reference: " + "; ".join(bad)
    return True, f"the kernels matched the jnp reference bit for bit on {len(SELF_CHECK_COPIES)} copies"


def _pallas(interpret: bool, reason: str) -> OperandKernels:
    return OperandKernels(
        PALLAS,
        reason,
        functools.partial(operand.spec_operand, interpret=interpret),
        functools.partial(operand.spec_operand_pair, interpret=interpret),
    )


def _jnp(reason: str) -> OperandKernels:
    return OperandKernels(JNP, reason, nvfp4.gemm_operand)


@functools.lru_cache(maxsize=None)  # one self-check per process and choice
def operand_kernels(choice: str = "auto") -> OperandKernels:
    """The operand quantizer for `quant_kernels=choice` on this process's devices, and why."""
    if choice not in QUANT_KERNELS:
        raise ValueError(f"quant_kernels={choice!r} is not allowed: choose one of {list(QUANT_KERNELS)}")
    on_gpu = jax.default_backend() == "gpu"
    if choice == JNP:
        return _jnp("quant_kernels=jnp")
    if choice == PALLAS:
        if on_gpu:
            return _pallas(False, "quant_kernels=pallas (Triton on the GPU, no self-check)")
        return _pallas(True, f"quant_kernels=pallas on {jax.default_backend()}: Pallas's interpreter "
                             "(bit-exact, far slower than jnp; for tests)")
    if not on_gpu:
        return _jnp(f"quant_kernels=auto on {jax.default_backend()}: the kernels need an NVIDIA GPU")
    if jax.device_count() > 1:
        return _jnp(f"quant_kernels=auto on {jax.device_count()} devices: the kernels are not "
                    "partitioned across devices (XLA would gather every operand)")
    ok, message = self_check()
    if ok:
        return _pallas(False, f"quant_kernels=auto: {message}")
    return _jnp(f"quant_kernels=auto: {message}; using jnp")


def with_operand_kernels(backend: NVFP4Backend, kernels: OperandKernels) -> NVFP4Backend:
    """`backend` with its operands computed by `kernels` (its GEMM must take the emulated form)."""
    if kernels.name == JNP and backend.operand is nvfp4.gemm_operand:
        return backend
    return dataclasses.replace(
        backend, name=f"{backend.name}+{kernels.name}", operand=kernels.operand,
        operand_pair=kernels.operand_pair, operand_group=None,  # the kernels quantize each operand
    )
