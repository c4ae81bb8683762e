"""The Pallas kernels, run in Pallas's interpreter on CPU, against the jnp reference bit for bit:
codes, scale bytes, amax, GEMM-operand values and decode scales, with the same SR bits for the
same key, on data built to break a quantizer (E2M1 ties, zero blocks, subnormal and underflowing
scales, tiny and non-finite tensors). Every test runs under IEEE and under GPU-legal float32
arithmetic (the `arithmetic` fixture), which reaches inside the kernels.

Interpreted kernels compile slowly (seconds per distinct call), so each compiled function is
reused across datasets and seeds, and shapes are small but span several tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.kernels import Copy, fused_quantize
from nvfp4_jax.kernels.select import SELF_CHECK_COPIES, kernels_vs_reference
from nvfp4_jax.nvfp4_spec import spread_data, tie_rich_data

pytestmark = pytest.mark.usefixtures("arithmetic")

SHAPE = (64, 96)  # with TILE: a 2 x 3 grid of programs, N not a power of two
TILE = (32, 32)
KEYS = jax.random.split(jax.random.key(7), 3)

# Every operand copy the quantized GEMM asks for, and the reference's arguments for each.
OPERAND_COPIES = SELF_CHECK_COPIES
# The storage form (packed codes along each copy's own axis).
PACKED_COPIES = (
    (Copy("rows", packed=True), dict(axis=1)),
    (Copy("rows", stochastic=True, packed=True), dict(axis=1, stochastic=True)),
    (Copy("tiles", packed=True), dict(two_d=True)),
    (Copy("cols", stochastic=True, packed=True), dict(axis=0, stochastic=True)),
    (Copy("cols", rht=True, stochastic=True, packed=True), dict(axis=0, rht=True, stochastic=True)),
)


def check_copies(x, copies, keys=None, skip=lambda copy: False):
    """Every copy by one fused kernel call against the reference, bit for bit (but `skip`)."""
    keys = list(jax.random.split(KEYS[0], len(copies))) if keys is None else keys
    diffs = kernels_vs_reference(x, copies, keys, interpret=True, tile=TILE)
    bad = {str(copy): d for (copy, _), d in zip(copies, diffs, strict=True) if d and not skip(copy)}
    assert not bad, f"elements differing from the reference on {x.dtype} data: {bad}"


def _nonfinite(seed, value):
    x = np.array(spread_data(seed, SHAPE), np.float32)
    x[5, 17] = value
    return x


BF16_DATA = {
    "spread (zero blocks, subnormal and underflowing scales)": lambda s: spread_data(s, SHAPE),
    "gaussian": lambda s: np.random.default_rng(s).standard_normal(SHAPE),
    "E2M1 ties in 1x16 blocks": lambda s: tie_rich_data(s, SHAPE),
    "E2M1 ties in 16x16 tiles": lambda s: tie_rich_data(s, SHAPE, two_d=True),
    "all zero": lambda s: np.zeros(SHAPE),
    "one NaN": lambda s: _nonfinite(s, np.nan),
    "one +Inf": lambda s: _nonfinite(s, np.inf),
    "one -Inf": lambda s: _nonfinite(s, -np.inf),
}


def _scaled(x, amax):
    x = np.array(x, np.float32)
    x = (x / np.abs(x).max() * np.float32(amax)).astype(np.float32)
    x[np.abs(x) < np.finfo(np.float32).tiny] = 0.0
    return x


def _tiny(seed):  # amax 1e-36: S_dec and some block-scale products are float32 subnormals
    return _scaled(spread_data(seed, SHAPE, sigma=1.0), 1e-36)


def _subnormal_elements(seed):
    x = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * np.float32(1e-38)
    x[0, :16] = 1.0
    return x


F32_DATA = {
    "wide range": lambda s: spread_data(s, SHAPE, sigma=4.0),
    "tiny tensor (amax 1e-36)": _tiny,
    "float32-subnormal elements": _subnormal_elements,
    "huge (amax 3e38)": lambda s: _scaled(spread_data(s, SHAPE, sigma=1.0), 3e38),
}


@pytest.mark.parametrize("data", sorted(BF16_DATA))
def test_operand_copies_match_reference_on_bf16(data):
    for seed in range(2):
        check_copies(jnp.asarray(np.asarray(BF16_DATA[data](seed), np.float32), jnp.bfloat16), OPERAND_COPIES)


@pytest.mark.parametrize("data", sorted(F32_DATA))
def test_operand_copies_match_reference_on_f32(data):
    # XLA:CPU flushes float32 subnormals, and how it fuses (and contracts) the RHT butterfly
    # decides which partial sums flush: docs/numerics.md leaves the RHT of such data unpinned
    # on a flushing backend (nvfp4_jax.device_check checks it on a GPU, which does not flush).
    x = F32_DATA[data](0)
    tiny_sums = bool(((np.abs(x) < np.finfo(np.float32).tiny * 2.0**12) & (x != 0)).any())
    for seed in range(2):
        check_copies(jnp.asarray(F32_DATA[data](seed), jnp.float32), OPERAND_COPIES,
                     skip=lambda copy: copy.rht and tiny_sums)


@pytest.mark.parametrize("data", ["spread (zero blocks, subnormal and underflowing scales)",
                                  "E2M1 ties in 1x16 blocks", "one NaN"])
def test_packed_copies_match_reference(data):
    for seed in range(2):
        check_copies(jnp.asarray(np.asarray(BF16_DATA[data](seed), np.float32), jnp.bfloat16), PACKED_COPIES)


def test_sr_bits_follow_the_key():
    # The same key gives the reference's bits (above, and here for a fresh pair of keys);
    # another key gives other codes on the same data.
    x = jnp.asarray(spread_data(5, SHAPE), jnp.bfloat16)
    keys = list(jax.random.split(KEYS[1], len(OPERAND_COPIES)))
    check_copies(x, OPERAND_COPIES, keys)
    copies = tuple(c for c, _ in OPERAND_COPIES)
    fused = jax.jit(lambda x, keys: fused_quantize(
        x, copies, [k if c.stochastic else None for c, k in zip(copies, keys)], tile=TILE, interpret=True))
    a, b = fused(x, keys), fused(x, keys[1:] + keys[:1])
    for (copy, _), (va, _), (vb, _) in zip(OPERAND_COPIES, a, b):
        changed = float(jnp.mean(va != vb))
        assert (0.05 < changed < 0.6) if copy.stochastic else changed == 0, (copy, changed)
