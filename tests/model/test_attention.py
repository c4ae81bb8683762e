"""Attention kernels: JAX's fused-attention API against ours; which kernel a run selects."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import assert_within, attention_error_bounds

from nvfp4_jax.model.attention import causal_attention, select_attention


def _qkv(kv_heads, dtype, L=24):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(kq, (2, L, 4, 16), jnp.float32)
    k = jax.random.normal(kk, (2, L, kv_heads, 16), jnp.float32)
    v = jax.random.normal(kv, (2, L, kv_heads, 16), jnp.float32)
    return tuple(a.astype(dtype) for a in (q, k, v))


def _xla(q, k, v):
    # The same API the cudnn_flash kernel calls, with XLA's implementation (runs on CPU).
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _forward_and_grads(fn, q, k, v, dy):
    y, vjp = jax.vjp(fn, q, k, v)
    return (y, *vjp(dy))


# fp32: each kernel is within its a-priori fp32 rounding bound of the exact (float64)
# attention (tests/tolerance.py: about 1e-5 of sum p|v| for the output), so the two agree; a
# wrong mask, scale or head grouping moves outputs by a large part of them, a bf16 intermediate
# by ~2^-9 relative: both far outside. bf16: both round the probabilities and the output to
# bf16 (one bf16 ulp is 2^-8 relative), gradients more so: bf16-sized tolerances, far above
# fp32 noise.
@pytest.mark.parametrize("dtype, fwd_tol, grad_tol", [(jnp.float32, None, None), (jnp.bfloat16, 2e-2, 6e-2)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_jax_dot_product_attention_matches_ours_forward_and_gradients(kv_heads, dtype, fwd_tol, grad_tol):
    q, k, v = _qkv(kv_heads, dtype)
    dy = jax.random.normal(jax.random.PRNGKey(4), q.shape, jnp.float32).astype(dtype)
    ours = jax.jit(lambda *a: _forward_and_grads(causal_attention, *a))(q, k, v, dy)
    theirs = jax.jit(lambda *a: _forward_and_grads(_xla, *a))(q, k, v, dy)
    exact = attention_error_bounds(q, k, v, dy) if dtype == jnp.float32 else None
    for name, a, b, tol in zip(("out", "dq", "dk", "dv"), ours, theirs, (fwd_tol,) + (grad_tol,) * 3):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if exact is not None:
            want, bound = exact[name]
            assert_within(a, want, bound, f"ours {name}")
            assert_within(b, want, bound, f"jax {name}")
            continue
        scale = np.abs(b).max()
        assert scale > 0.1, name
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=0, err_msg=name)


def test_causality_of_the_fused_api():
    q, k, v = _qkv(2, jnp.float32)
    t = 10
    grads = jax.grad(lambda k: _xla(q, k, v)[:, t].sum())(k)
    per_position = np.abs(np.asarray(grads)).sum(axis=(0, 2, 3))
    assert np.all(per_position[t + 1:] == 0) and np.all(per_position[: t + 1] > 0)


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
    platform: str
    compute_capability: str | None = None
    device_kind: str = "fake"


def test_explicit_kernels_and_the_maxtext_alias_are_taken_as_asked():
    assert select_attention("dot_product").kernel == "dot_product"
    assert select_attention("cudnn_flash").kernel == "cudnn_flash"
    choice = select_attention("cudnn_flash_te")
    assert choice.kernel == "cudnn_flash" and "MaxText" in choice.reason
    with pytest.raises(ValueError, match=r"attention='flash'.*autoselected"):
        select_attention("flash")


@pytest.mark.parametrize("device, pattern", [
    (_FakeDevice("cpu"), r"no NVIDIA GPU \(device platform 'cpu'\)"),
    (_FakeDevice("gpu", "7.5", "Tesla T4"), r"Tesla T4 has compute capability 7.5, below 8.0"),
    # Capability 9.0 but this process cannot compile cuDNN attention (CPU backend here).
    (_FakeDevice("gpu", "9.0", "H200"), r"cuDNN fused attention does not compile on H200"),
])
def test_autoselected_falls_back_to_dot_product_and_says_why(device, pattern):
    choice = select_attention("autoselected", device)
    assert choice.kernel == "dot_product"
    assert choice.reason.startswith("autoselected: ")
    assert re.search(pattern, choice.reason), choice.reason


def test_build_model_refuses_cudnn_attention_without_a_gpu():
    from nvfp4_jax.config import load_config
    from nvfp4_jax.train.build import build_model, describe_attention

    cfg = load_config(["attention=cudnn_flash_te"]).model
    with pytest.raises(ValueError, match=r"attention=cudnn_flash_te runs only on NVIDIA GPUs.*devices are cpu"):
        build_model(cfg)
    assert describe_attention(load_config([]).model).startswith("attention: dot_product (autoselected: no NVIDIA GPU")


def test_cudnn_flash_passes_packing_as_a_mask_never_as_segment_offsets(monkeypatch):
    """jax 0.10.2's cuDNN attention reads wrong keys for packed GQA batches only on its
    segment-offset path (`_fix_seqlen_offsets` scales `kv_offsets` by the query heads, N * H,
    instead of the KV heads: fixed in 0.11.1), which runs when `q_offsets`/`kv_offsets` give more
    than one segment per row. `cudnn_flash` must keep packing out of that path on every JAX: it
    hands `jax.nn.dot_product_attention` a boolean [B, 1, L, L] mask and no sequence lengths or
    offsets (docs/backends.md, "cuDNN attention and packed batches")."""
    from nvfp4_jax.model import attention

    seen = {}

    def fake(q, k, v, bias=None, mask=None, **kwargs):
        seen.update(kwargs, mask=mask, bias=bias)
        return q

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake)
    q = jnp.zeros((2, 8, 4, 16), jnp.bfloat16)
    kv = jnp.zeros((2, 8, 2, 16), jnp.bfloat16)  # GQA: 2 KV heads for 4 query heads
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 1, 0, 0]], jnp.int32)
    attention.cudnn_flash_attention(q, kv, kv, segment_ids_BxL=seg)
    assert seen["implementation"] == "cudnn" and seen["is_causal"] is True
    assert seen["bias"] is None
    assert seen["mask"].shape == (2, 1, 8, 8) and seen["mask"].dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(seen["mask"])[:, 0], np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    offsets = {"query_seq_lengths", "key_value_seq_lengths", "q_offsets", "kv_offsets"}
    assert not offsets & {k for k, v in seen.items() if v is not None}
