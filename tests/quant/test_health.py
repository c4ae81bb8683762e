"""Quantization health statistics: hand-built tensors with known answers, the dot's wiring, scan.

Expected values are derived by hand from the contract in docs/numerics.md (block scale = e4m3(amax_b * S_enc / 6),
S_enc = 2688 / amax), never read off the implementation.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_same_bits
from tolerance import error_statistic_rtol

from nvfp4_jax.quant import (
    dequantize_mxfp4,
    health,
    nvfp4_gemm_operand,
    quantize_fp8,
    quantize_mxfp4,
    random_hadamard_transform,
)
from nvfp4_jax.quant.dot import make_dot_general
from nvfp4_jax.quant.nvfp4_backend import sr_keys
from nvfp4_jax.quant.flax_dot import QuantDotGeneral, quant_rngs
from nvfp4_jax.quant.recipe import get_recipe

DIMS = (((1,), (0,)), ((), ()))
# Jitted: op-by-op, the integer-built quantizer is hundreds of tiny compilations.
nvfp4_stats = jax.jit(health.nvfp4_stats, static_argnames=("axis", "two_d", "rht", "stochastic"))

# Block amaxes of a [4, 64] tensor, 16 blocks of 16 along the last axis. The tensor amax is 2688,
# so S_enc = 1 and a block's scale is e4m3(amax_b / 6):
#   2688 -> 448 (the largest E4M3 value)          60 -> 10 (normal)
#   0.03 -> 0.005, rounds to 3 * 2**-9 (subnormal) 0.001 -> 1.7e-4 < 2**-10: rounds to 0
BLOCK_AMAX = [2688] * 4 + [0.001] * 4 + [0.03] * 2 + [0] * 2 + [60] * 4
# Each block: its amax at element 0, -amax/100 at element 5, zeros elsewhere. What Q gives the
# amax element: 6 * scale for every block with a non-zero scale (2688, 0.03515625, 60); the
# -amax/100 element is 0.06 below a block's scale in E2M1 units and rounds to 0 everywhere.
Q_OF_AMAX = {2688: 2688.0, 60: 60.0, 0.03: 6 * 3 * 2.0**-9, 0.001: 0.0, 0: 0.0}


def _hand_built():
    x = np.zeros((16, 16), np.float32)
    q = np.zeros((16, 16), np.float64)
    for b, a in enumerate(BLOCK_AMAX):
        x[b, 0], x[b, 5] = a, -a / 100
        q[b, 0] = Q_OF_AMAX[a]
    return x.reshape(4, 64), q.reshape(4, 64)


def test_nvfp4_block_fractions_zero_fraction_and_error_on_a_hand_built_tensor():
    x, q = _hand_built()
    got = nvfp4_stats(x, axis=-1)
    assert float(got["scale_max_frac"]) == 4 / 16
    assert float(got["scale_zero_frac"]) == 4 / 16  # the two all-zero blocks do not count
    assert float(got["scale_subnormal_frac"]) == 2 / 16
    # 28 non-zero values (14 blocks x 2); all 14 small ones and the 4 underflowing amaxes vanish.
    assert float(got["zero_frac"]) == np.float32(18) / np.float32(28)
    assert float(got["amax"]) == 2688.0
    x64 = x.astype(np.float64)
    want = np.linalg.norm(q - x64) / np.linalg.norm(x64)
    # q and x are the fp32 values the statistic sees, so only its own fp32 rounding differs.
    np.testing.assert_allclose(float(got["error"]), want, rtol=error_statistic_rtol(x.size))


def test_nvfp4_two_d_counts_16x16_tiles():
    w = np.zeros((32, 32), np.float32)
    w[0, 0] = 2688.0     # tile (0, 0): scale 448
    w[3, 20] = 0.001     # tile (0, 1): scale underflows
    w[20, 20] = 60.0     # tile (1, 1): normal; tile (1, 0) is all zero
    got = nvfp4_stats(jnp.asarray(w), axis=0, two_d=True)
    assert float(got["scale_max_frac"]) == 1 / 4
    assert float(got["scale_zero_frac"]) == 1 / 4
    assert float(got["scale_subnormal_frac"]) == 0.0
    assert float(got["zero_frac"]) == np.float32(1) / np.float32(3)


def test_rht_copies_are_measured_in_the_rotated_domain():
    x = np.zeros((32, 16), np.float32)
    x[3, 2] = 8.0  # one spike per 16-block along axis 0: the RHT spreads it to 16 values of +-2
    x[20:, :] = np.linspace(-1, 1, 12 * 16, dtype=np.float32).reshape(12, 16)
    rotated = nvfp4_stats(jnp.asarray(x), axis=0, rht=True)
    assert float(rotated["amax"]) == 2.0
    plain = nvfp4_stats(jax.jit(random_hadamard_transform, static_argnums=1)(jnp.asarray(x), 0), axis=0)
    for name in rotated:
        assert float(rotated[name]) == float(plain[name]), name
    assert float(nvfp4_stats(jnp.asarray(x), axis=0)["amax"]) == 8.0


def test_stochastic_statistics_describe_the_rounding_the_operand_got():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32), jnp.float32).astype(jnp.bfloat16)
    key = jax.random.PRNGKey(7)
    errors = []
    rtol = error_statistic_rtol(x.size)
    for k in (key, jax.random.PRNGKey(8)):
        values, decode = jax.jit(lambda v, k: nvfp4_gemm_operand(v, axis=1, stochastic=True, key=k))(x, k)
        # The dequantized operand as the statistic sees it: values * decode rounded to fp32.
        q = (np.asarray(values, np.float32) * np.float32(decode)).astype(np.float64)
        x64 = np.asarray(x, np.float64)
        want = np.linalg.norm(q - x64) / np.linalg.norm(x64)
        got = float(nvfp4_stats(x, axis=1, stochastic=True, key=k)["error"])
        np.testing.assert_allclose(got, want, rtol=rtol)
        errors.append(got)
    # The key matters, by more than rounding could explain: the statistics are not of some
    # other rounding.
    assert abs(errors[0] - errors[1]) > 2 * rtol * max(errors)


def test_all_zero_tensor_has_zero_statistics_not_nan():
    got = nvfp4_stats(jnp.zeros((16, 16)), axis=1)
    assert {k: float(v) for k, v in got.items()} == {k: 0.0 for k in got}


def test_fp8_saturated_and_zero_fractions():
    x = jnp.asarray([1000.0, -500.0, 100.0, 0.0005, 0.0, 1.0, 2.0, 3.0], jnp.float32)
    scale = jnp.float32(1.0)
    q = quantize_fp8(x, scale, "e4m3")
    got = health.fp8_stats(x, q.data, scale, q.scale_inv, "e4m3")
    assert float(got["saturated_frac"]) == 2 / 8  # |x| > 448
    assert float(got["zero_frac"]) == np.float32(1) / np.float32(7)  # 0.0005 is below half of E4M3's 2**-9
    x64 = np.asarray(x, np.float64)
    q64 = np.array([448.0, -448.0, 96.0, 0.0, 0.0, 1.0, 2.0, 3.0])  # 100 rounds to 96 (step 8)
    np.testing.assert_allclose(float(got["error"]), np.linalg.norm(q64 - x64) / np.linalg.norm(x64),
                               rtol=error_statistic_rtol(x.size))


def test_mxfp4_statistics():
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [6.0, 0.2, 0.3]  # scale 2**0: 0.2 -> 0, 0.3 -> 0.5
    got = health.mxfp4_stats(jnp.asarray(x), axis=1)
    assert float(got["zero_frac"]) == np.float32(1) / np.float32(3)
    x64 = x.astype(np.float64)[0, :3]  # the fp32 values of 0.2 and 0.3, not the decimals
    want = np.hypot(0.5 - x64[2], x64[1]) / np.linalg.norm(x64)
    np.testing.assert_allclose(float(got["error"]), want, rtol=error_statistic_rtol(x.size))
    assert set(got) == set(health.VALUE_STATS)


def test_mxfp4_statistics_measure_the_spec_and_key_quantized():
    """An RHT copy is measured in the rotated domain, an SR copy with its own key's rounding."""
    stats = jax.jit(health.mxfp4_stats, static_argnames=("axis", "rht", "stochastic"))
    x = jax.random.normal(jax.random.PRNGKey(4), (64, 32), jnp.float32)
    assert_same_bits(stats(x, axis=0, rht=True), stats(random_hadamard_transform(x, 0), axis=0))
    k1, k2 = jax.random.PRNGKey(5), jax.random.PRNGKey(6)
    sr1 = stats(x, axis=1, stochastic=True, key=k1)
    assert float(sr1["error"]) != float(stats(x, axis=1, stochastic=True, key=k2)["error"])
    q = dequantize_mxfp4(quantize_mxfp4(x, axis=1, stochastic=True, key=k1))
    assert_same_bits(sr1, jax.jit(health.value_stats)(x, q))


@pytest.mark.parametrize("flag", ["te_nvfp4", "nvfp4_1d_weights", "mxfp4", "mxfp4_nvfp4_recipe",
                                  "te_fp8_currentscaling"])
def test_the_dot_returns_each_operands_statistics_and_leaves_the_gemms_alone(flag):
    recipe = get_recipe(flag)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64), jnp.float32).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(jax.random.PRNGKey(1), (64, 32), jnp.float32)).astype(jnp.bfloat16)
    c = jax.random.normal(jax.random.PRNGKey(2), (32, 32), jnp.float32)
    key = jax.random.PRNGKey(3)

    def loss(x, w, stats):
        dot = make_dot_general(recipe, key if recipe.needs_rng else None, quant_stats=stats)
        return jnp.sum(dot(x, w, DIMS, preferred_element_type=jnp.float32) * c)

    with_stats = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w, health.init_stats(recipe))
    without = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, None)
    # Measuring changes nothing the layer computes.
    assert_same_bits((with_stats[0], with_stats[1][:2]), without)
    stats = with_stats[1][2]
    assert set(stats) == set(health.operands(recipe))
    want = jax.jit(_reference_stats, static_argnums=0)(recipe, x, w, c, key)
    # The same operands quantized alike: fractions and amax are exact; the error's sums may
    # round differently in the two programs (two fp32 evaluations: twice the bound).
    rtol = 2 * error_statistic_rtol(max(x.size, w.size, c.size))
    for op, values in want.items():
        for name, v in values.items():
            if name == "error":
                np.testing.assert_allclose(float(stats[op][name]), float(v), rtol=rtol, err_msg=f"{op}.{name}")
            else:
                assert float(stats[op][name]) == float(v), f"{op}.{name}"


def _reference_stats(recipe, x, w, g, key):
    """Each operand's statistics computed directly, from docs/recipes.md's table of
    which tensor each GEMM quantizes along which axis (g: the cotangent of the fp32 output)."""
    if recipe.format in ("nvfp4", "mxfp4"):
        # The NVFP4 recipe's operand handling is the same for both FP4 formats.
        stats = health.nvfp4_stats if recipe.format == "nvfp4" else health.mxfp4_stats
        k_dgrad, k_wgrad = sr_keys(key) if recipe.sr_gradients else (None, None)
        sr = recipe.sr_gradients
        want = {
            "x": stats(x, axis=1),
            "w": stats(w, axis=0, two_d=recipe.two_d_weights),
            "dy": stats(g, axis=1, stochastic=sr, key=k_dgrad),
            "x_wgrad": stats(x, axis=0, rht=recipe.rht_wgrad),
            "dy_wgrad": stats(g, axis=0, rht=recipe.rht_wgrad, stochastic=sr, key=k_wgrad),
        }
        if not recipe.two_d_weights:
            want["w_dgrad"] = stats(w, axis=1)
    else:
        # Current scaling: scale = 448 / amax (E4M3) or 57344 / amax (E5M2 gradients).
        def fp8(t, fmt):
            scale = jnp.float32({"e4m3": 448.0, "e5m2": 57344.0}[fmt]) / jnp.max(jnp.abs(t.astype(jnp.float32)))
            q = quantize_fp8(t, scale, fmt)
            return health.fp8_stats(t, q.data, scale, q.scale_inv, fmt)

        want = {"x": fp8(x, "e4m3"), "w": fp8(w, "e4m3"), "dy": fp8(g, "e5m2")}
    return want


def test_a_malformed_statistics_pytree_is_refused():
    with pytest.raises(ValueError, match="quant_stats must have the structure"):
        make_dot_general(get_recipe("nvfp4_no_sr"), quant_stats={"x": {"amax": jnp.zeros(())}})
    with pytest.raises(ValueError, match="BF16 GEMM quantizes nothing"):
        health.init_stats(get_recipe("bf16"))


def test_flatten_names_projections_and_splits_stacked_layers():
    unrolled = {"layers_1": {"mlp": {"gate": {"QuantDotGeneral_0": {
        "x": {"amax": np.float32(2.0), "error": np.float32(0.5)}}}}}}
    assert health.flatten(unrolled) == {"layers_1/mlp/gate": {"x": {"amax": 2.0, "error": 0.5}}}
    stacked = {"layers": {"mlp": {"up": {"QuantDotGeneral_0": {
        "w": {"amax": np.array([1.0, 2.0, 3.0], np.float32)}}}}}}
    assert health.flatten(stacked) == {f"layers/mlp/up[{i}]": {"w": {"amax": float(i + 1)}} for i in range(3)}
    assert [health.layer_index(p) for p in ("layers_3/mlp/up", "layers/mlp/up[2]", "lm_head")] == [3, 2, None]


class _Block(nn.Module):
    """One projection with a quantized dot that measures its operands, as a scanned layer."""

    @nn.compact
    def __call__(self, x, _):
        w = self.param("w", nn.initializers.normal(0.2), (x.shape[-1], x.shape[-1]))
        dot = QuantDotGeneral(get_recipe("nvfp4_no_sr"), quant_stats=True)
        y = dot(x, w.astype(jnp.bfloat16), DIMS, preferred_element_type=jnp.float32)
        return jnp.tanh(y).astype(jnp.bfloat16), None


@pytest.mark.slow
def test_statistics_of_scanned_layers_come_out_stacked_and_match_the_unrolled_layers():
    """Under nn.scan the collection gets a leading layer axis (variable_axes={"quant_stats": 0});
    each slice must be that layer's statistics."""
    layers = 3
    scanned = nn.scan(_Block, variable_axes={"params": 0, health.COLLECTION: 0},
                      split_rngs={"params": True}, length=layers)()
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 32), jnp.float32).astype(jnp.bfloat16)
    variables = scanned.init(jax.random.PRNGKey(1), x, None)
    stacked_zeros = variables[health.COLLECTION]

    def loss(stats, apply, params):
        out, _ = apply({"params": params, health.COLLECTION: stats}, x, None, rngs=quant_rngs(jax.random.PRNGKey(2)))
        return jnp.sum(out.astype(jnp.float32) ** 2)

    stacked = jax.jit(jax.grad(loss), static_argnums=1)(stacked_zeros, scanned.apply, variables["params"])
    flat = health.flatten(stacked)
    assert len(flat) == layers and all(name.endswith(f"[{i}]") for i, name in enumerate(sorted(flat)))

    # The same layers unrolled: layer i's parameters are slice i of the stacked ones.
    block = _Block()
    params = [jax.tree.map(lambda p: p[i], variables["params"]) for i in range(layers)]
    zeros = [jax.tree.map(lambda z: z[i], stacked_zeros) for i in range(layers)]

    def unrolled_loss(stats_list):
        h = x
        for p, s in zip(params, stats_list):
            h, _ = block.apply({"params": p, health.COLLECTION: s}, h, None, rngs=quant_rngs(jax.random.PRNGKey(2)))
        return jnp.sum(h.astype(jnp.float32) ** 2)

    per_layer = jax.jit(jax.grad(unrolled_loss))(zeros)
    for i, name in enumerate(sorted(flat)):
        want = health.flatten({"layer": per_layer[i]})["layer"]
        for op in want:
            # The same layer's operands (bf16 activations, fp32 weights) in either program, so
            # counts and amax are exact; the error's sums may fuse differently (twice the bound
            # of one fp32 evaluation).
            assert set(flat[name][op]) == set(want[op]), (name, op)
            for stat, value in want[op].items():
                if stat == "error":
                    rtol = 2 * error_statistic_rtol(x.size)
                    assert flat[name][op][stat] == pytest.approx(value, rel=rtol, abs=0), (name, op)
                else:
                    assert flat[name][op][stat] == value, (name, op, stat)
