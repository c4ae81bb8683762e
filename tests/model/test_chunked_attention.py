"""The chunked kernel and segment masks: every kernel against dot_product and per-document runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_within, attention_error_bounds

from nvfp4_jax.model.attention import (
    CHUNKED_ABOVE, causal_attention, fused_api_attention, select_attention,
)
from nvfp4_jax.model.chunked_attention import chunked_attention


def _qkv(L, kv_heads, dtype=jnp.float32, B=2, H=4, K=16, seed=3):
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (B, L, H, K), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, L, kv_heads, K), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, L, kv_heads, K), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, (B, L, H, K), jnp.float32).astype(dtype)
    return q, k, v, dy


def _segments(L):
    # Row 0: three documents and two padding tokens (id 0); row 1: one document.
    a, b = L // 3, L // 2
    row0 = np.concatenate([np.full(a, 1), np.full(b - a, 2), np.full(L - b - 2, 3), np.zeros(2)])
    return jnp.asarray(np.stack([row0, np.ones(L)]), jnp.int32)


def _chunked(block):
    def fn(q, k, v, *, segment_ids_BxL=None):
        return chunked_attention(q, k, v, segment_ids_BxL=segment_ids_BxL, block_size=block)
    return fn


def _xla_fused(q, k, v, *, segment_ids_BxL=None):
    # The cudnn_flash kernel's own call (mask from the segment ids), run by XLA's implementation.
    return fused_api_attention(q, k, v, segment_ids_BxL=segment_ids_BxL, implementation="xla")


def _forward_and_grads(fn, q, k, v, dy, seg):
    y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids_BxL=seg), q, k, v)
    return (y, *vjp(dy))


def _assert_fp32_exact_within_bounds(outs, q, k, v, dy, seg, key_blocks=1, what=""):
    """Each of out, dq, dk, dv within the a-priori fp32 rounding bound of the exact (float64)
    attention (tests/tolerance.py); `key_blocks`: the online softmax's rescalings. Two kernels
    that pass agree within the sum of their bounds. A wrong mask, scale or head grouping moves
    outputs by a large part of them, a bf16 intermediate by ~2^-9 relative: far outside."""
    bounds = attention_error_bounds(q, k, v, dy, segment_ids=seg, key_blocks=key_blocks)
    for name, a in zip(("out", "dq", "dk", "dv"), outs):
        assert a.dtype == jnp.float32, name
        want, bound = bounds[name]
        assert_within(a, want, bound, f"{what} {name}")


def _assert_close(ours, theirs, tols, names=("out", "dq", "dk", "dv")):
    for name, a, b, tol in zip(names, ours, theirs, tols):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = np.abs(b).max()
        assert scale > 0.1, name
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=0, err_msg=name)


# L not a multiple of the block (37 = 4 x 8 + 5, 24 = 16 + 8), one block (block > L); GQA, MQA
# and MHA; with and without segments.
@pytest.mark.parametrize("L, block, kv_heads, segmented", [
    (37, 8, 2, True), (37, 8, 2, False), (24, 16, 1, True), (24, 8, 4, False), (13, 64, 2, True),
])
def test_chunked_matches_dot_product_in_fp32_forward_and_gradients(L, block, kv_heads, segmented):
    q, k, v, dy = _qkv(L, kv_heads)
    seg = _segments(L) if segmented else None
    ours = jax.jit(lambda *a: _forward_and_grads(_chunked(block), *a, seg))(q, k, v, dy)
    ref = jax.jit(lambda *a: _forward_and_grads(causal_attention, *a, seg))(q, k, v, dy)
    # Same fp32 scores; only the softmax's order of operations differs (online vs at once).
    _assert_fp32_exact_within_bounds(ours, q, k, v, dy, seg, key_blocks=-(-L // block), what="chunked")
    _assert_fp32_exact_within_bounds(ref, q, k, v, dy, seg, what="dot_product")


def test_chunked_matches_dot_product_in_bf16():
    q, k, v, dy = _qkv(40, 2, jnp.bfloat16)
    seg = _segments(40)
    ours = jax.jit(lambda *a: _forward_and_grads(_chunked(16), *a, seg))(q, k, v, dy)
    ref = jax.jit(lambda *a: _forward_and_grads(causal_attention, *a, seg))(q, k, v, dy)
    # Both round probabilities to bf16 before the products with V (2^-8 relative each), the
    # chunked kernel before normalising them: bf16-sized differences, gradients more so (far
    # above fp32 noise, so a hand-set tolerance, not an fp32 bound).
    _assert_close(ours, ref, (2e-2, 6e-2, 6e-2, 6e-2))


def test_fused_api_mask_from_segments_matches_dot_product():
    q, k, v, dy = _qkv(24, 2)
    seg = _segments(24)
    ours = jax.jit(lambda *a: _forward_and_grads(_xla_fused, *a, seg))(q, k, v, dy)
    ref = jax.jit(lambda *a: _forward_and_grads(causal_attention, *a, seg))(q, k, v, dy)
    _assert_fp32_exact_within_bounds(ours, q, k, v, dy, seg, what="fused xla")
    _assert_fp32_exact_within_bounds(ref, q, k, v, dy, seg, what="dot_product")


@pytest.mark.parametrize("fn, key_blocks", [(causal_attention, 1), (_chunked(8), 4), (_xla_fused, 1)],
                         ids=["dot_product", "chunked", "fused_xla"])
def test_a_packed_row_equals_each_document_attended_alone(fn, key_blocks):
    L = 30
    q, k, v, _ = _qkv(L, 2, B=1)
    bounds = [0, 7, 19, 30]  # documents of 7, 12 and 11 tokens
    seg = jnp.asarray(np.repeat([1, 2, 3], np.diff(bounds))[None], jnp.int32)
    packed = np.asarray(jax.jit(lambda q, k, v: fn(q, k, v, segment_ids_BxL=seg))(q, k, v))
    # Exactly, the packed row's documents are the documents alone; in fp32 each side is within
    # its rounding bound of that (chunked: 4 key blocks of 8).
    packed_bound = attention_error_bounds(q, k, v, segment_ids=seg, key_blocks=key_blocks)["out"][1]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        alone = np.asarray(causal_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]))
        alone_bound = attention_error_bounds(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])["out"][1]
        assert_within(packed[:, lo:hi], alone, packed_bound[:, lo:hi] + alone_bound, f"document {lo}:{hi}")


@pytest.mark.parametrize("segmented", [False, True])
def test_chunked_causality_and_segments_by_gradient(segmented):
    L, t = 29, 17
    q, k, v, _ = _qkv(L, 2)
    seg = _segments(L) if segmented else None

    def out_at_t(k, v):
        return _chunked(8)(q, k, v, segment_ids_BxL=seg)[:, t].sum()

    dk, dv = jax.grad(out_at_t, argnums=(0, 1))(k, v)
    seen = (np.abs(np.asarray(dk)).sum(axis=(2, 3)) + np.abs(np.asarray(dv)).sum(axis=(2, 3))) > 0
    positions = np.arange(L)
    for row in range(2):
        allowed = positions <= t
        if segmented:
            allowed &= np.asarray(seg[row]) == np.asarray(seg[row, t])
        np.testing.assert_array_equal(seen[row], allowed, err_msg=f"row {row}")


def test_chunked_never_reads_key_blocks_above_the_diagonal():
    # NaN keys and values from block 2 on: any visit of those blocks by an earlier query block
    # would make its output NaN (0 * NaN), even behind a mask; dot_product shows the effect.
    C, L = 8, 40
    q, k, v, dy = _qkv(L, 2)
    k = k.at[:, 2 * C:].set(jnp.nan)
    v = v.at[:, 2 * C:].set(jnp.nan)
    out = np.asarray(jax.jit(_chunked(C))(q, k, v))
    assert np.isfinite(out[:, : 2 * C]).all() and np.isnan(out[:, 2 * C:]).all()
    assert np.isnan(np.asarray(causal_attention(q, k, v))[:, : 2 * C]).all()
    clean_q, clean_k, clean_v, _ = _qkv(L, 2)
    # The first two blocks' rows see the clean keys only: chunked (5 key blocks at most) and
    # dot_product each within their fp32 bound of the exact attention of the clean inputs.
    bound = sum(attention_error_bounds(clean_q, clean_k, clean_v, key_blocks=n)["out"][1] for n in (L // C, 1))
    assert_within(out[:, : 2 * C], np.asarray(causal_attention(clean_q, clean_k, clean_v))[:, : 2 * C],
                  bound[:, : 2 * C])


def test_chunked_backward_never_reads_query_blocks_below_the_diagonal():
    # dK and dV of key block j need query blocks i >= j only: NaN queries and output gradients
    # in block 0 leave dK, dV of blocks 1.. finite.
    C, L = 8, 32
    q, k, v, dy = _qkv(L, 2)
    q = q.at[:, :C].set(jnp.nan)
    dy = dy.at[:, :C].set(jnp.nan)
    _, _, dk, dv = jax.jit(lambda *a: _forward_and_grads(_chunked(C), *a, None))(q, k, v, dy)
    for g in (np.asarray(dk), np.asarray(dv)):
        assert np.isfinite(g[:, C:]).all() and np.isnan(g[:, :C]).all()


def _shapes_in(jaxpr):
    import jax.extend.core  # noqa: F401

    find = getattr(jax.extend.core, "jaxprs_in_params", None) or jax.core.jaxprs_in_params
    shapes = set()
    for eqn in jaxpr.eqns:
        shapes |= {tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars}
        for sub in find(eqn.params):
            shapes |= _shapes_in(sub)
    return shapes


def test_chunked_forward_and_backward_hold_no_l_by_l_tensor():
    L, C = 64, 16
    q, k, v, dy = _qkv(L, 2)

    def shapes(fn):
        loss = lambda q, k, v: (fn(q, k, v) * dy).sum()  # noqa: E731
        return _shapes_in(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)

    def has_lxl(shape_set):
        return any(s.count(L) >= 2 for s in shape_set)

    assert has_lxl(shapes(causal_attention))  # the check can see an L x L tensor
    chunked = shapes(_chunked(C))
    assert not has_lxl(chunked)
    assert any(s[-2:] == (C, C) for s in chunked)


def test_autoselected_off_gpu_picks_chunked_only_for_long_sequences():
    short = select_attention("autoselected", seq_len=CHUNKED_ABOVE)
    long = select_attention("autoselected", seq_len=CHUNKED_ABOVE + 1)
    assert short.kernel == "dot_product" and select_attention("autoselected").kernel == "dot_product"
    assert long.kernel == "chunked" and f"> {CHUNKED_ABOVE}" in long.reason
    assert select_attention("chunked", seq_len=16).kernel == "chunked"


def test_build_model_selects_chunked_for_long_sequences_off_gpu():
    from nvfp4_jax.config import load_config
    from nvfp4_jax.train.build import build_model, describe_attention

    long = load_config(["max_target_length=4096"]).model
    assert describe_attention(long).startswith("attention: chunked (autoselected: no NVIDIA GPU")
    assert build_model(long).attention_kernel == "chunked"
    assert build_model(load_config(["max_target_length=2048"]).model).attention_kernel == "dot_product"


def test_chunked_under_all_gather_context_parallelism_is_warned_and_ulysses_is_not():
    from nvfp4_jax.config import load_config
    from nvfp4_jax.train.build import context_attention_warning

    def warning(*keys, ways=8):
        return context_attention_warning(load_config(list(keys)).model, ways)

    text = warning("max_target_length=4096")  # autoselected picks chunked; all_gather is the default
    assert text.startswith("warning: attention=chunked under context_parallel_strategy=all_gather with "
                           "ici_context_parallelism=8") and "\n" not in text and "ulysses" in text
    assert warning("max_target_length=4096", "context_parallel_strategy=ulysses") is None
    assert warning("max_target_length=4096", ways=1) is None
    assert warning("max_target_length=2048") is None  # dot_product: partitioned by queries
    assert warning("attention=chunked", "max_target_length=256", ways=2) is not None
