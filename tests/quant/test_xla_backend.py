"""The xla backend on CPU: `jax.nn.scaled_matmul` replaced by `scaled_matmul_reference`, a
pure-jnp transcription of its documented semantics (scaled_matmul has no CPU lowering).

What must hold: every operand handed to scaled_matmul is the emulated recipe's operand bit for
bit (codes and E4M3 scales vs `quantize_nvfp4`, dequantized views vs `nvfp4_gemm_operand`), and
the backend's outputs and gradients equal the emulated backend's within fp32 accumulation order.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_close_to_sum, einsum_with_terms, gamma

from nvfp4_jax.quant import (
    dequantize,
    get_recipe,
    make_backend,
    make_dot_general,
    nvfp4_gemm_operand,
    quantize_nvfp4,
    scaled_matmul_reference,
    unpack_codes,
    xla_operand,
)
from nvfp4_jax.quant.nvfp4_backend import NVFP4Backend, emulated_gemm, sr_keys
from nvfp4_jax.quant.nvfp4 import gemm_operand
from nvfp4_jax.quant.xla_backend import (
    BlockScaledOperand,
    ScaledMatmulGemm,
    check_scaled_matmul_args,
    cudnn_block_scaled_gemm_in,
    probe_scaled_matmul,
)

XLA = make_backend("xla", scaled_matmul=scaled_matmul_reference)
KEY = jax.random.PRNGKey(7)


def _data(shape, seed, dtype=jnp.bfloat16, scale=1.0):
    return (scale * jax.random.normal(jax.random.PRNGKey(seed), shape)).astype(dtype)


def _bytes(a):
    return np.asarray(a).view(np.uint8)


def _view_values(codes, scales):
    """codes * (scales repeated over their 16-blocks), fp32: a view's dequantized operand."""
    s = np.repeat(np.asarray(scales.astype(jnp.float32)), 16, axis=-1)
    return np.asarray(codes.astype(jnp.float32)) * s


# --- operands ---------------------------------------------------------------------------------

# (name, shape, dtype, quantizer arguments): every operand of the recipe's three GEMMs.
OPERANDS = [
    ("X along K", (64, 96), jnp.bfloat16, dict(axis=1)),
    ("W 16x16 tiles", (96, 48), jnp.float32, dict(axis=0, two_d=True)),
    ("W along K (1x16 weights)", (96, 48), jnp.float32, dict(axis=0)),
    ("W along N (1x16 weights)", (96, 48), jnp.bfloat16, dict(axis=1)),
    ("dY along N, SR", (64, 48), jnp.bfloat16, dict(axis=1, stochastic=True, key=KEY)),
    ("X along T, RHT", (64, 96), jnp.bfloat16, dict(axis=0, rht=True)),
    ("dY along T, RHT + SR", (64, 48), jnp.bfloat16, dict(axis=0, rht=True, stochastic=True, key=KEY)),
]


@functools.partial(jax.jit, static_argnums=2)
def _three_forms(x, key, kw):
    """The xla operand, the storage form and the emulated operand of one quantization."""
    kw = dict(kw, key=key)
    return xla_operand(x, **kw), quantize_nvfp4(x, **kw), nvfp4_gemm_operand(x, **kw)


@pytest.mark.parametrize("name, shape, dtype, kw", OPERANDS, ids=[o[0] for o in OPERANDS])
def test_operands_are_the_emulated_ones_bitwise(name, shape, dtype, kw):
    x = _data(shape, 3, dtype, scale=3.0)
    kw = dict(kw)
    key = kw.pop("key", None)
    op, q, (values, decode) = _three_forms(x, key, tuple(sorted(kw.items())))
    codes = np.asarray(unpack_codes(q))
    scale_bytes = _bytes(q.scales)
    assert np.asarray(op.decode).view(np.uint32) == np.asarray(decode).view(np.uint32)
    assert all(c.dtype == jnp.float4_e2m1fn for c in op.codes)
    assert all(s.dtype == jnp.float8_e4m3fn for s in op.scales)
    if kw.get("two_d"):
        # One set of codes seen from both sides; tile scales repeated along the free axis.
        assert op.axes == (0, 1)
        tiles = scale_bytes
        want = {0: (codes.T, np.repeat(tiles.T, 16, 0)), 1: (codes, np.repeat(tiles, 16, 0))}
    else:
        axis = kw["axis"]
        assert op.axes == (axis,)
        want = {axis: (codes.T, scale_bytes.T) if axis == 0 else (codes, scale_bytes)}
    for axis, (want_codes, want_scales) in want.items():
        got_codes, got_scales = op.view(axis)
        assert np.array_equal(_bytes(got_codes), want_codes), axis
        assert np.array_equal(_bytes(got_scales), want_scales), axis
        # Dequantized, the view is the emulated operand (transposed so that K is last).
        emulated = np.asarray(values.astype(jnp.float32))
        emulated = emulated.T if axis == 0 else emulated
        assert np.array_equal(_view_values(got_codes, got_scales), emulated), axis


def test_negative_zero_and_every_code_survive_the_float4_cast():
    # All 16 codes with unit scales: -0 (code 8) must stay -0 in float4_e2m1fn.
    grid = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    x = jnp.asarray(np.concatenate([grid, -grid]).reshape(1, 16).repeat(16, 0) * (6 / 6))
    op = xla_operand(x, axis=1)
    assert np.array_equal(_bytes(op.codes[0]), np.asarray(unpack_codes(quantize_nvfp4(x, axis=1))))
    assert sorted(set(_bytes(op.codes[0]).ravel().tolist())) == list(range(16))


# --- what scaled_matmul is handed, GEMM by GEMM -----------------------------------------------


def test_each_gemm_hands_scaled_matmul_the_spec_operands():
    """Record the three scaled_matmul calls of forward+backward (te_nvfp4) and check each
    operand pair against the emulated quantizer applied as docs/recipes.md's table says."""
    calls = []

    def recording(*args, **kw):
        jax.debug.callback(lambda *a: calls.append(a), *args)
        return scaled_matmul_reference(*args, **kw)

    backend = make_backend("xla", scaled_matmul=recording)
    x, w, g = _data((32, 64), 1), _data((64, 48), 2, jnp.float32), _data((32, 48), 3, jnp.float32)

    @jax.jit
    def fwd_bwd(x, w, g):
        y, vjp = jax.vjp(lambda a, b: make_dot_general(get_recipe("te_nvfp4"), KEY, backend=backend)(
            a, b, (((1,), (0,)), ((), ()))), x, w)
        return y, vjp(g)

    y, _ = jax.block_until_ready(fwd_bwd(x, w, g))
    jax.effects_barrier()
    assert len(calls) == 3
    k_dgrad, k_wgrad = sr_keys(KEY)

    def emulated(a, key=None, **kw):
        values = _three_forms(a, key, tuple(sorted(kw.items())))[2][0]
        return np.asarray(values.astype(jnp.float32))

    want = [
        (emulated(x, axis=1), emulated(w, axis=0, two_d=True).T),  # FPROP: (T, K), (N, K)
        (emulated(g, axis=1, stochastic=True, key=k_dgrad), emulated(w, axis=0, two_d=True)),  # DGRAD
        (emulated(x, axis=0, rht=True).T, emulated(g, axis=0, rht=True, stochastic=True, key=k_wgrad).T),
    ]
    # The callbacks are unordered effects: identify each GEMM by its lhs shape (T, K), (T, N), (K, T).
    order = {(32, 64): 0, (32, 48): 1, (64, 32): 2}
    calls = sorted(calls, key=lambda call: order[tuple(call[0].shape[1:])])
    for (lhs, rhs, lhs_s, rhs_s), (want_lhs, want_rhs), gemm in zip(calls, want, ("fprop", "dgrad", "wgrad")):
        assert lhs.dtype == rhs.dtype == jnp.float4_e2m1fn and lhs_s.dtype == jnp.float8_e4m3fn, gemm
        assert lhs.ndim == 3 and lhs.shape[0] == 1 and lhs_s.shape[-1] * 16 == lhs.shape[-1], gemm
        assert np.array_equal(_view_values(lhs[0], lhs_s[0]), want_lhs), gemm
        assert np.array_equal(_view_values(rhs[0], rhs_s[0]), want_rhs), gemm
    # The decode scales multiply the fp32 result: FPROP equals the dequantized product.
    q_x = _three_forms(x, None, (("axis", 1),))[1]
    q_w = _three_forms(w, None, (("axis", 0), ("two_d", True)))[1]
    want_y, terms = einsum_with_terms("tk,kn->tn", dequantize(q_x), dequantize(q_w))
    # y: exact E2M1 x E4M3 products, a K=64 fp32 sum, times alpha = decode_x * decode_w (2
    # roundings); each dequantized factor of the reference is rounded once: gamma(K + 3). A
    # missing decode scale is off by a factor amax / 2688, far outside it.
    assert_close_to_sum(y, want_y, terms, n=64, extra_roundings=3, out_dtype=y.dtype)


# --- outputs and gradients vs the emulated backend ---------------------------------------------


def _fwd_bwd(flag, backend, x, w, g):
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    kw = {} if backend is None else dict(backend=backend)
    y, vjp = jax.vjp(lambda a, b: make_dot_general(get_recipe(flag), KEY, **kw)(
        a, b, dims, preferred_element_type=jnp.float32), x, w)
    return (y, *vjp(g))


_fwd_bwd_jit = jax.jit(_fwd_bwd, static_argnums=(0, 1))


def _abs_operand(x, spec, key=None):
    values, decode = gemm_operand(x, spec, key)
    return jnp.abs(values), jnp.abs(decode)


# The emulated GEMMs on |operands|: sum|terms| of each of the three GEMMs, whatever operands
# (2D W, RHT, SR with its key) the recipe quantizes.
ABS_TERMS = NVFP4Backend("abs terms", _abs_operand, emulated_gemm)

# The model's shapes: [batch, seq, D] x [D, F] (gate/up) and [batch, seq, F] x [F, D] (down),
# with bf16 activations and an fp32 master weight, and a plain 2-D token matrix.
# The recipes' operand variants are all in te_nvfp4 (2D W, RHT, SR) and nvfp4_1d_weights.
CASES = [
    ("te_nvfp4", (2, 32, 64), (64, 96)),
    ("te_nvfp4", (2, 32, 96), (96, 64)),
    ("nvfp4_1d_weights", (48, 32), (32, 80)),
    ("te_nvfp4_no_rht", (2, 16, 32), (32, 48)),
]


@pytest.mark.slow
@pytest.mark.parametrize("flag, lhs_shape, rhs_shape", CASES)
def test_outputs_and_gradients_match_the_emulated_backend(flag, lhs_shape, rhs_shape):
    x, w = _data(lhs_shape, 1), _data(rhs_shape, 2, jnp.float32, 0.05)
    g = _data(lhs_shape[:-1] + rhs_shape[-1:], 3, jnp.float32)
    got = _fwd_bwd_jit(flag, XLA, x, w, g)
    want = _fwd_bwd_jit(flag, None, x, w, g)
    terms = _fwd_bwd_jit(flag, ABS_TERMS, x, w, g)
    # Reduction lengths: K for Y, N for dX, the T tokens for dW.
    lengths = (lhs_shape[-1], rhs_shape[-1], int(np.prod(lhs_shape[:-1])))
    for name, a, b, t, n in zip(("y", "dx", "dw"), got, want, terms, lengths):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # Both backends sum the same exact products (the same operands, bit for bit) in fp32 in
        # their own order, then multiply by the same alpha: n + 1 roundings a side, two sides,
        # plus one rounding to bf16 where the result is (dX in X's dtype). sum|terms| is itself an
        # fp32 (dX: bf16) GEMM of positive terms, so within 2**-8 of exact: 1 + 2**-7 covers it.
        t = np.asarray(t, np.float64) * (1 + 2.0**-7)
        assert_close_to_sum(a, b, t, n, extra_roundings=1, sides=2, out_dtype=a.dtype, what=name)


def test_a_wrong_scale_layout_would_be_caught():
    """The comparison above can fail: the 2D weight's tile scales used from the wrong side
    (FPROP reading the DGRAD view's scales) change the output well beyond tolerance."""

    def swapped(x, spec, key=None):
        op = XLA.operand(x, spec, key)
        if op.axes != (0, 1):
            return op
        codes, (by_k, by_n) = op.codes, op.scales
        wrong = jnp.repeat(by_n[::16].T, 16, axis=0)[:, : by_k.shape[1]]  # tiles, transposed badly
        return BlockScaledOperand(codes, (wrong.T[: by_k.shape[0]].reshape(by_k.shape), by_n), op.decode, op.axes)

    w = _data((64, 64), 2, jnp.float32) * jnp.repeat(jnp.repeat(
        jnp.asarray(np.random.default_rng(0).uniform(0.1, 10, (4, 4)), jnp.float32), 16, 0), 16, 1)
    x = _data((32, 64), 1)
    bad = make_dot_general(get_recipe("nvfp4_no_sr"), backend=XLA.__class__("xla", swapped, XLA.gemm))
    good = make_dot_general(get_recipe("nvfp4_no_sr"), backend=XLA)
    dims = (((1,), (0,)), ((), ()))
    a, b = np.asarray(bad(x, w, dims), np.float64), np.asarray(good(x, w, dims), np.float64)
    assert np.abs(a - b).max() > 0.05 * np.abs(b).max()


def test_quant_dot_general_runs_the_xla_backend():
    """Through the Flax seam (QuantDotGeneral, rng stream "quant"): loss and gradients of one
    projection, xla vs emulated."""
    from nvfp4_jax.quant import QuantDotGeneral, quant_rngs

    x, w = _data((2, 16, 32), 5), _data((32, 48), 6, jnp.float32)
    dims = (((2,), (0,)), ((), ()))

    def loss_and_grads(backend):
        mod = QuantDotGeneral(get_recipe("te_nvfp4"), nvfp4_backend=backend)

        def loss(x, w):
            y = mod.apply({}, x, w, dims, preferred_element_type=jnp.float32, rngs=quant_rngs(KEY))
            return jnp.mean(jnp.square(y)), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

    ((l_xla, y_xla), g_xla), ((l_emu, y_emu), g_emu) = loss_and_grads(XLA), loss_and_grads(make_backend("emulated"))
    # Y: the same exact products summed in two orders (as above, K = 32). The loss, mean(Y^2):
    # |l_xla - l_emu| <= mean(|y_xla^2 - y_emu^2|) + each side's rounding of its mean of squares
    # (a square, the n - 1 additions, the division by n: gamma(n + 5) of the mean each).
    (_, y_terms), _ = loss_and_grads(ABS_TERMS)
    y_terms = np.asarray(y_terms, np.float64) * (1 + 2.0**-7)
    assert_close_to_sum(y_xla, y_emu, y_terms, 32, extra_roundings=1, sides=2, what="y")
    ya, yb = np.asarray(y_xla, np.float64), np.asarray(y_emu, np.float64)
    n = ya.size
    loss_bound = np.mean(np.abs(ya**2 - yb**2)) + gamma(n + 5) * (float(l_xla) + float(l_emu))
    assert abs(float(l_xla) - float(l_emu)) <= loss_bound
    for a, b in zip(g_xla, g_emu):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # Not an fp32 bound: dY = 2 Y / n is quantized (SR) from each backend's own Y, which may
        # differ in the last bits, so an E2M1 code (or dY's amax, hence every scale) may flip.
        # One bf16 ulp of the largest gradient is far above fp32 noise and far below what a wrong
        # operand (test_a_wrong_scale_layout_would_be_caught: 5%) does.
        np.testing.assert_allclose(a, b, rtol=2**-8, atol=2**-8 * np.abs(b).max())


# --- errors -----------------------------------------------------------------------------------


def test_operand_errors():
    with pytest.raises(ValueError, match=r"2-D .* got shape \(2, 16, 32\)"):
        xla_operand(jnp.ones((2, 16, 32)))
    with pytest.raises(ValueError, match="multiple of 16"):
        xla_operand(jnp.ones((16, 40)), axis=1)
    op = xla_operand(jnp.ones((32, 64)), axis=1)
    with pytest.raises(ValueError, match="blocks along axis 1, so only that axis can be contracted"):
        op.view(0)


def test_gemm_errors():
    gemm = ScaledMatmulGemm(scaled_matmul_reference)
    a, b = xla_operand(jnp.ones((32, 64)), axis=1), xla_operand(jnp.ones((64, 48)), axis=0)
    with pytest.raises(ValueError, match="no batch dims"):
        gemm(a, b, (((1,), (0,)), ((0,), (0,))), jnp.float32)
    with pytest.raises(ValueError, match="blocks along axis 1"):
        gemm(a, b, (((0,), (0,)), ((), ())), jnp.float32)
    short = xla_operand(jnp.ones((32, 48)), axis=1)  # K = 48 vs 64
    with pytest.raises(ValueError, match="equal batch and contraction sizes"):
        gemm(short, b, (((1,), (0,)), ((), ())), jnp.float32)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 4, 32), (1, 4, 32), (1, 4, 2), (4, 2)), "3-D"),
        (((1, 4, 32), (2, 4, 32), (1, 4, 2), (2, 4, 2)), "equal batch and contraction"),
        (((1, 4, 32), (1, 4, 48), (1, 4, 2), (1, 4, 3)), "equal batch and contraction"),
        (((1, 4, 32), (1, 5, 32), (1, 4, 2), (1, 4, 2)), "match their operand"),
        (((1, 4, 32), (1, 4, 32), (1, 4, 3), (1, 4, 3)), "block size dividing K=32"),
        (((1, 4, 32), (1, 4, 32), (1, 4, 2), (1, 4, 4)), "block size dividing K=32"),
    ],
)
def test_scaled_matmul_argument_errors(shapes, match):
    with pytest.raises(ValueError, match=match):
        check_scaled_matmul_args(*(jnp.ones(s) for s in shapes))


def test_reference_matches_its_documented_formula():
    """The reference is elementwise v * scale in fp32, then a K=32 fp32 dot. Against the exact
    formula on the same fp32 inputs (float64: a * s is exact there), each term went through 2
    roundings (the two dequantized factors) before the dot's own gamma(K): the bound is
    gamma(K + 2) * sum|terms|, about 2e-6 of it. A dropped or misplaced scale (factors in
    [0.5, 2]) or a transposed operand moves an element by a large part of sum|terms|."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((2, 8, 32)), rng.standard_normal((2, 4, 32))
    sa, sb = rng.uniform(0.5, 2, (2, 8, 2)), rng.uniform(0.5, 2, (2, 4, 2))
    a, b, sa, sb = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, sa, sb))
    want, terms = einsum_with_terms("bmk,bnk->bmn", a * np.repeat(sa, 16, -1), b * np.repeat(sb, 16, -1))
    got = scaled_matmul_reference(*(jnp.asarray(v, jnp.float32) for v in (a, b, sa, sb)))
    assert got.dtype == jnp.float32
    assert_close_to_sum(got, want, terms, n=32, extra_roundings=2)


# --- the start-up probe -----------------------------------------------------------------------


# JAX 0.11 added a CPU lowering of scaled_matmul (XLA's dequantize-then-dot rewrite).
_SCALED_MATMUL_ON_CPU = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def test_probe_on_this_machine():
    probe = probe_scaled_matmul()
    if jax.devices()[0].platform == "cpu":
        assert not probe.fused
        if _SCALED_MATMUL_ON_CPU:
            assert probe.lowers and "dequantize-then-dot" in probe.detail
        else:
            assert not probe.lowers and "does not lower on cpu" in probe.detail
    assert probe_scaled_matmul() is probe  # once per device


@pytest.mark.slow
@pytest.mark.skipif(not _SCALED_MATMUL_ON_CPU, reason="jax.nn.scaled_matmul lowers on CPU from JAX 0.11")
@pytest.mark.parametrize("flag, lhs_shape, rhs_shape", CASES[:1] + CASES[2:3])
def test_real_scaled_matmul_on_cpu_equals_its_documented_semantics(flag, lhs_shape, rhs_shape):
    """The xla backend with JAX's own `scaled_matmul` (CPU lowering, JAX >= 0.11) against the
    same backend on `scaled_matmul_reference`, outputs and both gradients: bit for bit. Both
    dequantize exactly (E2M1 x E4M3 products are exact in fp32) and accumulate the same fp32
    products over K in one dot; measured equal on these shapes (jax 0.12.0.1, XLA:CPU)."""
    x, w = _data(lhs_shape, 1), _data(rhs_shape, 2, jnp.float32, 0.05)
    g = _data(lhs_shape[:-1] + rhs_shape[-1:], 3, jnp.float32)
    real = make_backend("xla")
    got = _fwd_bwd_jit(flag, real, x, w, g)
    want = _fwd_bwd_jit(flag, XLA, x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), err_msg=name)


def test_cudnn_kernel_is_recognised_in_compiled_hlo():
    fused = '%f = f32[1,128,128] fusion(...), kind=kCustom, backend_config={"kind":"__cudnn$fusion"} composite.name="block_scaled_dot"'
    assert cudnn_block_scaled_gemm_in(fused)
    assert cudnn_block_scaled_gemm_in('custom_call_target="__cudnn$blockScaledDot"')
    rewritten = "%d = f32[1,128,128] dot(f32[1,128,64] %a, f32[1,128,64] %b), composite.name=\"block_scaled_dot\""
    assert not cudnn_block_scaled_gemm_in(rewritten)


def test_operand_group_equals_each_operand_on_its_own():
    """The xla backend's `operand_group` (one set of per-tensor factors for a pass) gives bit for
    bit `block_scaled_operand` of each operand alone: codes, scales, decode and views."""
    from nvfp4_jax.quant.spec import OperandSpec
    from nvfp4_jax.quant.xla_backend import block_scaled_operand, block_scaled_operand_group

    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((32, 64)) * 1e-3, jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)) * 50, jnp.float32)
    g = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    key = jax.random.key(5)
    items = [(x, OperandSpec(axis=1), None), (w, OperandSpec(two_d=True), None),
             (g, OperandSpec(axis=0, rht=True, stochastic=True), key)]
    together = block_scaled_operand_group(items)
    for (a, spec, k), got in zip(items, together):
        want = block_scaled_operand(a, spec, k)
        assert got.axes == want.axes
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.atleast_1d(u).view(np.uint8), np.atleast_1d(v).view(np.uint8), err_msg=str(spec))
