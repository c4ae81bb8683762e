"""The one quantize entry point and the one block-scaled tensor type: every (format, form) pair
holds the numbers its keyword form holds, bit for bit, and bad choices are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_jax.quant import (BlockScaledTensor, MXFP4Tensor, NVFP4Tensor, OperandSpec, dequantize,
                             nvfp4_gemm_operand, quantize, quantize_mxfp4, quantize_nvfp4, xla_operand)

X = jax.random.normal(jax.random.PRNGKey(3), (32, 64), jnp.float32) * 5.0
KEY = jax.random.PRNGKey(7)
SPECS = [OperandSpec(axis=1), OperandSpec(axis=0, rht=True), OperandSpec(two_d=True),
         OperandSpec(axis=1, stochastic=True)]


def _bits(tree):
    return [np.atleast_1d(np.asarray(leaf)).view(np.uint8) for leaf in jax.tree_util.tree_leaves(tree)]


def _kw(spec):
    return dict(axis=spec.axis, two_d=spec.two_d, rht=spec.rht, stochastic=spec.stochastic)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
def test_every_nvfp4_form_is_its_keyword_form_bit_for_bit(spec):
    key = KEY if spec.stochastic else None
    for form, keyword in (("storage", quantize_nvfp4), ("operand", nvfp4_gemm_operand),
                          ("block_scaled", xla_operand)):
        got = quantize(X, spec, key, format="nvfp4", form=form)
        want = keyword(X, key=key, **_kw(spec))
        for g, w in zip(_bits(got), _bits(want), strict=True):
            np.testing.assert_array_equal(g, w, err_msg=form)
    # The storage form and the operand form hold the same numbers.
    stored = quantize(X, spec, key)
    values, decode = quantize(X, spec, key, form="operand")
    np.testing.assert_array_equal(np.asarray(dequantize(stored)),
                                  np.asarray(values.astype(jnp.float32) * decode))


@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: s.label)
def test_mxfp4_storage_is_its_keyword_form_and_a_block_scaled_tensor(spec):
    got = quantize(X, spec, format="mxfp4")
    want = quantize_mxfp4(X, **_kw(spec))
    assert isinstance(got, MXFP4Tensor) and isinstance(got, BlockScaledTensor) and got.amax is None
    for g, w in zip(_bits(got), _bits(want), strict=True):
        np.testing.assert_array_equal(g, w)
    # 32-element blocks, E8M0 scales, values 2**e * e2m1: a power-of-two multiple of an E2M1 value.
    assert got.scales.dtype == jnp.float8_e8m0fnu and got.BLOCK == 32
    assert got.scales.size == X.size // (32 * 32 if spec.two_d else 32)


def test_both_formats_share_one_tensor_type_and_stay_pytrees_through_jit():
    nv = quantize(X, OperandSpec(axis=1))
    mx = quantize(X, OperandSpec(axis=1), format="mxfp4")
    assert type(nv) is NVFP4Tensor and issubclass(NVFP4Tensor, BlockScaledTensor) and nv.BLOCK == 16
    for q in (nv, mx):
        leaves, tree = jax.tree_util.tree_flatten(q)
        assert len(leaves) == (3 if q is nv else 2)  # codes, scales (and NVFP4's amax)
        again = jax.jit(lambda t: t)(q)
        assert type(again) is type(q) and (again.shape, again.axis) == (q.shape, q.axis)
        np.testing.assert_array_equal(np.asarray(jax.jit(dequantize)(q)), np.asarray(dequantize(q)))
    # The formats really differ: the same input dequantizes to different values.
    assert not np.array_equal(np.asarray(dequantize(nv)), np.asarray(dequantize(mx)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(format="nvfp8"), "quantize: format='nvfp8' is not allowed: one of nvfp4, mxfp4"),
    (dict(form="packed"), "quantize: form='packed' is not allowed: one of storage, operand, block_scaled"),
    (dict(format="mxfp4", form="operand"), "quantize: form='operand' is not one of mxfp4's forms: storage"),
])
def test_bad_format_or_form_is_one_line_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        quantize(X, OperandSpec(axis=1), **kwargs)
    assert str(err.value) == message


def test_dequantize_refuses_what_is_not_a_stored_tensor():
    with pytest.raises(ValueError, match="dequantize: q has type ndarray; expected one of NVFP4Tensor"):
        dequantize(np.zeros(3))
