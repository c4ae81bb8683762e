"""Llama model: causality, the dot_general seam, RoPE, attention, RMSNorm, parameter count."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import ml_dtypes
import pytest
from tolerance import (
    DIVISION_ROUNDINGS, TRANSCENDENTAL_ROUNDINGS, U, assert_within, attention_error_bounds, gamma,
)

from nvfp4_jax.config import ModelConfig, make_config
from nvfp4_jax.flops import parameter_count
from nvfp4_jax.model import Llama
from nvfp4_jax.model.attention import causal_attention
from nvfp4_jax.model.layers import RMSNorm, apply_rope, rope_frequencies

SMALL = ModelConfig(
    vocab_size=64, base_emb_dim=32, base_num_query_heads=4, base_num_kv_heads=2, head_dim=8,
    base_mlp_dim=48, base_num_decoder_layers=4, max_target_length=16, scan_layers=False,
)  # unrolled: per-layer module paths; test_layout.py covers the scanned layout
B, L = 2, 8


def _tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, SMALL.vocab_size)


@pytest.fixture(scope="module")
def variables():
    # Initialising costs seconds on CPU (random-number kernels compile); the tests share one.
    return jax.jit(Llama(SMALL).init)(jax.random.PRNGKey(0), jnp.zeros((B, L), jnp.int32))


def test_init_is_fp32_and_counted_exactly(variables):
    assert list(variables) == ["params"]
    leaves = jax.tree.leaves(nn.meta.unbox(variables["params"]))
    assert all(x.dtype == jnp.float32 for x in leaves)
    assert sum(x.size for x in leaves) == parameter_count(SMALL)


def test_causality_by_gradient(variables):
    model = Llama(SMALL)
    x_BxLxD = model.apply(variables, _tokens(), method=Llama.embed)
    t = 4

    def logits_at_t(x):
        return model.apply(variables, x, method=Llama.decode)[:, t].sum()

    grad_BxLxD = np.asarray(jax.jit(jax.grad(logits_at_t))(x_BxLxD).astype(jnp.float32))
    per_position = np.abs(grad_BxLxD).sum(axis=(0, 2))
    assert np.all(per_position[t + 1:] == 0.0), per_position
    assert np.all(per_position[: t + 1] > 0.0), per_position


_SEEN_DTYPES = set()


def _plain_factory():
    def dot(lhs, rhs, *args, **kwargs):
        # A given dot gets the activations in the compute dtype and the fp32 master kernel;
        # casting the kernel itself makes it the model's own bf16 path.
        _SEEN_DTYPES.add((lhs.dtype, rhs.dtype))
        return jax.lax.dot_general(lhs, rhs.astype(lhs.dtype), *args, **kwargs)

    return dot


def test_plain_dot_seam_is_bit_identical(variables):
    tokens = _tokens()
    plain = Llama(SMALL)
    seamed = Llama(SMALL, mlp_dot_general_cls=_plain_factory, attention_dot_general_cls=_plain_factory)
    abstract = jax.eval_shape(seamed.init, jax.random.PRNGKey(0), tokens)
    assert jax.tree.structure(abstract) == jax.tree.structure(variables)
    _SEEN_DTYPES.clear()
    np.testing.assert_array_equal(plain.apply(variables, tokens), seamed.apply(variables, tokens))
    assert _SEEN_DTYPES == {(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))}


# (tag, module path, lhs shape, rhs shape) per call, appended at trace time.
_LOG = []


class _Recorder(nn.Module):
    """A dot_general module that records where it was created and what it multiplies."""

    tag: str

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        self.make_rng("quant")
        self.variable("fp8_meta", "calls", lambda: jnp.zeros((), jnp.int32))
        _LOG.append((self.tag, self.scope.path, lhs.shape, rhs.shape))
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)


def test_seam_routes_mlp_and_attention_projections_of_quantized_layers_only(variables):
    cfg = ModelConfig(**{**SMALL.__dict__, "bf16_first_layers": 1, "bf16_last_layers": 1})
    _LOG.clear()
    model = Llama(cfg, mlp_dot_general_cls=lambda: _Recorder("mlp"),
                  attention_dot_general_cls=lambda: _Recorder("attention"))
    keys = {"params": jax.random.PRNGKey(0), "quant": jax.random.PRNGKey(2)}
    abstract = jax.eval_shape(model.init, keys, _tokens())
    D, F, HK, GK = 32, 48, 32, 16
    expected = set()
    for layer in ("layers_1", "layers_2"):
        for name, shapes in (("gate", (D, F)), ("up", (D, F)), ("down", (F, D))):
            expected.add(("mlp", (layer, "mlp", name, "_Recorder_0"), shapes))
        for name, shapes in (("query", (D, HK)), ("key", (D, GK)), ("value", (D, GK)), ("out", (HK, D))):
            expected.add(("attention", (layer, "attention", name, "_Recorder_0"), shapes))
    got = [(tag, path, rhs) for tag, path, lhs, rhs in _LOG]
    assert len(got) == len(expected) == 14
    assert set(got) == expected
    # The attention projections see [B, L, K] activations; a given MLP dot sees the tokens
    # flattened, [B * L, K] (the MLP's elementwise work on the GEMMs' own shape).
    assert all(lhs[:-1] == ((B * L,) if tag == "mlp" else (B, L)) for tag, _, lhs, _ in _LOG), _LOG
    # Each projection's module owns its own variables, under its projection.
    meta = jax.tree_util.tree_flatten_with_path(abstract["fp8_meta"])[0]
    assert {tuple(k.key for k in path[:-1]) for path, _ in meta} == {p for _, p, _ in expected}
    assert jax.tree.structure(abstract["params"]) == jax.tree.structure(variables["params"])
    fp8_meta = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract["fp8_meta"])
    _LOG.clear()
    model.apply({**variables, "fp8_meta": fp8_meta}, _tokens(), rngs={"quant": jax.random.PRNGKey(3)})
    assert len(_LOG) == 14


def test_bf16_layers_ignore_the_factories(variables):
    def doubling():
        return lambda *a, **k: 2 * jax.lax.dot_general(*a, **k)

    tokens = _tokens()
    expected = Llama(SMALL).apply(variables, tokens)
    all_bf16 = ModelConfig(**{**SMALL.__dict__, "bf16_first_layers": 2, "bf16_last_layers": 2})
    np.testing.assert_array_equal(
        Llama(all_bf16, doubling, doubling).apply(variables, tokens), expected
    )
    for mlp, attention in ((doubling, None), (None, doubling)):
        out = Llama(SMALL, mlp, attention).apply(variables, tokens)
        assert not np.allclose(out, expected)


def _rope_reference(x_LxK, positions, inv_freq):
    """Rotation of the complex numbers x[i] + i x[i + K/2], in float64."""
    x = np.asarray(x_LxK, np.float64)
    half = x.shape[-1] // 2
    z = (x[:, :half] + 1j * x[:, half:]) * np.exp(1j * np.outer(positions, inv_freq))
    return np.concatenate([z.real, z.imag], axis=-1)


def _rope_bound(x_LxK, positions, inv_freq):
    """fp32 rounding bound of apply_rope per element: the angle position * fl32(inv_freq) is
    rounded twice (gamma(2) |angle| absolute, the large angles' share), cos and sin err by
    TRANSCENDENTAL_ROUNDINGS u, then two products and a sum: |x1| + |x2| times all that."""
    x = np.asarray(x_LxK, np.float64)
    half = x.shape[-1] // 2
    angle = np.abs(np.outer(positions, inv_freq))
    pair = np.abs(x[:, :half]) + np.abs(x[:, half:])
    b = pair * (gamma(2) * angle + (TRANSCENDENTAL_ROUNDINGS + 3) * U)
    return np.concatenate([b, b], axis=-1)


def test_rope_matches_complex_rotation_and_preserves_norms():
    inv_freq = rope_frequencies(16, 500_000.0)
    x_1xLx1xK = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 1, 16), jnp.float32)
    positions = np.arange(0, 1200, 100)
    rotated = np.asarray(apply_rope(x_1xLx1xK, jnp.asarray(positions), inv_freq))[0, :, 0]
    x = np.asarray(x_1xLx1xK)[0, :, 0]
    expected = _rope_reference(x, positions, inv_freq)
    bound = _rope_bound(x, positions, inv_freq)  # ~1e-4 at position 1100: the fp32 angle
    assert_within(rotated, expected, bound, "rotated")
    # A rotation keeps the norm: the rotated vector's norm is off by at most the error's norm.
    assert_within(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x.astype(np.float64), axis=-1),
                  np.linalg.norm(bound, axis=-1), "norms")


def test_rope_score_depends_only_on_relative_position():
    inv_freq = rope_frequencies(16, 10_000.0)
    q, k = jax.random.normal(jax.random.PRNGKey(5), (2, 1, 1, 1, 16), jnp.float32)

    def score(m, n):
        qm = apply_rope(q, jnp.array([m]), inv_freq)
        kn = apply_rope(k, jnp.array([n]), inv_freq)
        return float(jnp.sum(qm * kn))

    def bound(m, n):
        """fp32 rounding bound of score(m, n): both rotations' errors (`_rope_bound`) through
        the 16-term product sum, plus that sum's own gamma(16)."""
        q64, k64 = (np.asarray(a, np.float64).reshape(1, 16) for a in (q, k))
        eq, ek = _rope_bound(q64, [m], inv_freq), _rope_bound(k64, [n], inv_freq)
        # |a rotated element| <= |x1| + |x2| of its pair; computed, plus its error.
        pq, pk = (np.concatenate([np.abs(a[:, :8]) + np.abs(a[:, 8:])] * 2, -1) for a in (q64, k64))
        return float((eq * (pk + ek) + pq * ek).sum() + gamma(16) * ((pq + eq) * (pk + ek)).sum())

    # Exactly, the score depends on n - m only; in fp32 each side is within its bound.
    for m, n in ((5, 2), (3, 9), (7, 7)):
        for shift in (1, 17, 250):
            assert abs(score(m + shift, n + shift) - score(m, n)) <= bound(m + shift, n + shift) + bound(m, n)
    assert abs(score(5, 2) - score(5, 3)) > max(1e-3, bound(5, 2) + bound(5, 3))


def _llama31_frequencies_reference(dim, theta, factor, low, high, old_context):
    # Meta's published apply_scaling (llama-models, Llama 3.1), written out in float64.
    freqs = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    out, regimes = [], set()
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
            regimes.add("high")
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
            regimes.add("low")
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
            regimes.add("mid")
    return np.array(out), regimes


def test_rope_llama31_scaling_matches_published_formula():
    cfg = make_config({"model_name": "llama3.1-405b"}).model
    got = rope_frequencies(cfg.head_dim, cfg.rope_max_timescale, cfg.rope_scaling_factor,
                           cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                           cfg.rope_original_max_position)
    expected, regimes = _llama31_frequencies_reference(
        cfg.head_dim, cfg.rope_max_timescale, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor, cfg.rope_original_max_position)
    assert regimes == {"high", "mid", "low"}
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=0)
    unscaled = rope_frequencies(cfg.head_dim, cfg.rope_max_timescale)
    assert not np.allclose(got, unscaled)


def _attention_reference(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("blhk,bmhk->bhlm", q, k) / np.sqrt(q.shape[-1])
    L = q.shape[1]
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhlm,bmhk->blhk", probs, v)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_causal_attention_matches_float64_reference(kv_heads):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(kq, (2, 6, 4, 8), jnp.float32)
    k = jax.random.normal(kk, (2, 6, kv_heads, 8), jnp.float32)
    v = jax.random.normal(kv, (2, 6, kv_heads, 8), jnp.float32)
    # fp32 inputs: the only error is fp32 rounding, within its a-priori bound (tests/tolerance.py).
    got = jax.jit(causal_attention)(q, k, v)
    assert_within(got, _attention_reference(q, k, v), attention_error_bounds(q, k, v)["out"][1])


def test_rmsnorm_matches_numpy():
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 16), jnp.float32) * 3.0
    scale = jax.random.normal(jax.random.PRNGKey(4), (16,), jnp.float32)
    norm = RMSNorm(epsilon=1e-5, dtype=jnp.float32)
    out = norm.apply({"params": {"scale": scale}}, x)
    xd = np.asarray(x, np.float64)
    expected = xd / np.sqrt(np.mean(xd**2, axis=-1, keepdims=True) + np.float32(1e-5)) * np.asarray(scale)
    # fp32: a mean of 16 squares (positive terms: 16 + the division's roundings, relative), + eps,
    # rsqrt, then two products: gamma(16 + DIVISION + 1 + TRANSCENDENTAL + 2) of |expected|.
    rtol = gamma(16 + DIVISION_ROUNDINGS + 1 + TRANSCENDENTAL_ROUNDINGS + 2)
    assert_within(out, expected, rtol * np.abs(expected))


def _abstract_param_count(cfg):
    shapes = jax.eval_shape(Llama(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes["params"])))


@pytest.mark.parametrize(
    "name, published",
    [("tiny", None), ("small-25m", None), ("llama3-8b", 8_030_261_248), ("llama3.1-405b", 405.9e9)],
)
def test_parameter_count_of_presets(name, published):
    cfg = make_config({"model_name": name}).model
    count = parameter_count(cfg)
    assert _abstract_param_count(cfg) == count
    if published is not None:
        assert abs(count - published) / published < 0.005
    if name == "llama3-8b":
        assert count == published


@pytest.mark.parametrize("recipe", ["te_nvfp4", "te_fp8_delayedscaling"])
def test_quantized_projections_get_their_kernel_gradient_in_fp32(recipe):
    """WGRAD leaves the quantized dot in fp32: Dense hands it the fp32 kernel, not a bf16 copy."""
    from nvfp4_jax.model.layers import Dense
    from nvfp4_jax.quant import dot_general_factory, get_recipe

    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 32), jnp.float32).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 48), jnp.float32)
    quantized = Dense(48, ("embed", "mlp"), dot_general_cls=dot_general_factory(get_recipe(recipe)))
    plain = Dense(48, ("embed", "mlp"))
    variables = nn.meta.unbox(
        jax.jit(quantized.init)({"params": jax.random.PRNGKey(2), "quant": jax.random.PRNGKey(3)}, x))

    def kernel_grad(dense):
        def f(params):
            out = dense.apply({**variables, "params": params}, x, rngs={"quant": jax.random.PRNGKey(4)})
            return jnp.vdot(out.astype(jnp.float32), dy)
        return jax.jit(jax.grad(f))(variables["params"])["kernel"]

    def bf16_rounded(a):
        return np.array_equal(np.asarray(a), np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32)))

    got = kernel_grad(quantized)
    assert got.dtype == jnp.float32
    assert not bf16_rounded(got)  # a bf16 cast on the way would leave only bf16 values
    # The bf16 lax.dot_general path keeps casting the kernel, so its gradient is bf16-valued.
    assert bf16_rounded(kernel_grad(plain))


def test_embedding_gradient_adds_repeated_tokens_in_fp32():
    from nvfp4_jax.model.layers import Embed

    embed = Embed(vocab_size=8, features=16)
    tokens = jnp.zeros((4, 256), jnp.int32).at[:, ::2].set(3)  # token 3 and token 0, 512 times each
    variables = nn.meta.unbox(embed.init(jax.random.PRNGKey(0), tokens))
    # Multiples of 1/8 up to 2 in magnitude (exact in bf16): every partial sum of 512 of them is
    # a multiple of 1/8 below 1024, exact in fp32 in any order, so the fp32 gradient is the
    # exact sum bit for bit. A bf16 accumulator (8 significant bits) cannot hold those sums.
    steps = jax.random.randint(jax.random.PRNGKey(1), (4, 256, 16), -16, 17)
    dy = (steps.astype(jnp.float32) / 8).astype(jnp.bfloat16)
    _, vjp = jax.vjp(lambda p: embed.apply({"params": p}, tokens), variables["params"])
    grad = np.asarray(vjp(dy)[0]["embedding"])
    dy64 = np.asarray(dy, np.float64)
    want = np.zeros((8, 16))
    np.add.at(want, np.asarray(tokens).ravel(), dy64.reshape(-1, 16))
    assert grad.dtype == np.float32
    np.testing.assert_array_equal(grad, want)
    assert np.all(grad[[1, 2, 4, 5, 6, 7]] == 0)
    # The data can tell: the same sums accumulated in bf16 (in token order) are not the exact ones.
    bf16_sum = np.zeros((8, 16), ml_dtypes.bfloat16)
    for t, row in zip(np.asarray(tokens).ravel(), np.asarray(dy).reshape(-1, 16)):
        bf16_sum[t] = (bf16_sum[t] + row).astype(ml_dtypes.bfloat16)
    assert not np.array_equal(bf16_sum.astype(np.float64), want)
