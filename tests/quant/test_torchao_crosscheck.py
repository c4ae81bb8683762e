"""Cross-check against an implementation nobody here wrote: torchao (CPU torch).

torchao's `NVFP4Tensor.to_nvfp4` computes the block scale as (amax_b / 6) / per_tensor_scale
with per_tensor_scale = amax / 2688, and encodes with (1 / per_tensor_scale) / s_b, where TE
(and we) use amax_b * fl32(S_enc * fl32(1/6)) and 1 / (s_b * S_dec). The scale bytes agree on
ordinary data; the codes agree except where x * enc_b sits within an ulp of an E2M1 rounding
tie (bf16 inputs hit those). torchao also clamps scales below 2**-6 (TE keeps E4M3
subnormals) -- spec section 11.
"""

import importlib
import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _import_torchao(module: str):
    """The module, or a skip where torchao is not installed at all (no `test` extra). Where it
    is installed (CI installs the `test` extra), a failing import is a failure, not a skip: a
    moved module must not silently turn the cross-check off."""
    try:
        importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchao is not installed (pip install -e '.[test]')", allow_module_level=True)
    return importlib.import_module(module)


torch = _import_torchao("torch")
nvfp4_tensor = _import_torchao("torchao.prototype.mx_formats.nvfp4_tensor")
mx_tensor = _import_torchao("torchao.prototype.mx_formats.mx_tensor")

from nvfp4_jax.quant import quantize_mxfp4, quantize_nvfp4  # noqa: E402
from nvfp4_jax.quant.formats import unpack_nibbles  # noqa: E402

pytestmark = [pytest.mark.crosscheck, pytest.mark.torch, pytest.mark.usefixtures("arithmetic")]

TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def ordinary_data(seed, shape=(128, 256)):
    rng = np.random.default_rng(seed)
    m, n = shape
    mag = np.exp(rng.standard_normal((m, n // 16, 1)))
    return (rng.standard_normal((m, n // 16, 16)) * mag).reshape(m, n).astype(np.float32)


def torchao_nvfp4(x: np.ndarray):
    xt = torch.from_numpy(np.array(x))
    pts = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(xt)))
    t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(xt, block_size=16, per_tensor_scale=pts)
    return t.qdata.view(torch.uint8).numpy(), t.scale.view(torch.uint8).numpy()


def ours_nvfp4(x: np.ndarray):
    q = jax.jit(quantize_nvfp4)(jnp.asarray(x))
    return np.asarray(q.codes), np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)), q


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_codes_and_scales_match_float32(seed):
    x = ordinary_data(seed)
    codes, scales, _ = ours_nvfp4(x)
    t_codes, t_scales = torchao_nvfp4(x)
    assert t_codes.shape == codes.shape and t_scales.shape == scales.shape
    np.testing.assert_array_equal(scales, t_scales)
    np.testing.assert_array_equal(codes, t_codes)  # same packing: element 2i in the low nibble


def test_nvfp4_bfloat16_differs_only_at_rounding_ties():
    x = np.asarray(jnp.asarray(ordinary_data(5), jnp.bfloat16).astype(jnp.float32))
    codes, scales, q = ours_nvfp4(x)
    t_codes, t_scales = torchao_nvfp4(x)
    np.testing.assert_array_equal(scales, t_scales)
    ours, theirs = (np.asarray(unpack_nibbles(jnp.asarray(c), 1)) for c in (codes, t_codes))
    diff = np.argwhere(ours != theirs)
    assert len(diff) < 1e-3 * ours.size
    # Every difference is one grid step at an E2M1 tie, from the encode-scale op order.
    amax = np.float32(q.amax)
    s_dec = np.float32(1) / np.minimum(np.float32(2688) / amax, np.finfo(np.float32).max)
    s_b = scales.view(jnp.float8_e4m3fn).astype(np.float32)
    for i, j in diff:
        y = abs(float(x[i, j] * (np.float32(1) / (s_b[i, j // 16] * s_dec))))
        assert np.min(np.abs(TIES - y)) <= 4e-7 * y
        assert abs(int(ours[i, j] & 7) - int(theirs[i, j] & 7)) == 1


def test_nvfp4_documented_difference_subnormal_scales():
    # One outlier pushes a block's scale into the E4M3 subnormal range: TE keeps 3 * 2**-9
    # (byte 0x03), torchao clamps to 2**-6 (byte 0x08).
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 16] = 2688.0, 0.03
    _, scales, _ = ours_nvfp4(x)
    _, t_scales = torchao_nvfp4(x)
    assert scales.tolist() == [[0x7E, 0x03]] and t_scales.tolist() == [[0x7E, 0x08]]


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_matches_rceil(seed):
    x = ordinary_data(seed, (64, 256)) * np.float32(10.0 ** (2 * seed - 1))
    q = jax.jit(quantize_mxfp4)(jnp.asarray(x))
    t = mx_tensor.MXTensor.to_mx(
        torch.from_numpy(x), torch.float4_e2m1fn_x2, 32, scaling_mode=mx_tensor.ScaleCalculationMode.RCEIL
    )
    np.testing.assert_array_equal(np.asarray(q.codes), t.qdata.view(torch.uint8).numpy())
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)),
        t.scale.view(torch.uint8).numpy().reshape(q.scales.shape),
    )
