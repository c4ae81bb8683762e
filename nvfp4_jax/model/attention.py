"""Causal grouped-query attention kernels, and which one a run uses.

Shape letters as in `layers.py`: B batch, L query positions, M key positions, H query heads,
G key/value heads, R = H / G, K head dim.

- `dot_product`: scores and softmax in fp32, materialised per head (`[B, G, R, L, M]`), then a
  second product with V. Runs everywhere; its saved probabilities grow with L^2.
- `cudnn_flash`: cuDNN's fused attention through `jax.nn.dot_product_attention(...,
  implementation="cudnn")`: no L x M tensor in memory, only the output and a log-sum-exp per
  query row are kept for the backward pass. NVIDIA GPUs of compute capability 8.0 or newer, bf16.
- `autoselected`: `cudnn_flash` where a trial compilation of it succeeds on an NVIDIA GPU,
  `dot_product` elsewhere. `select_attention` says which and why.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# MaxText calls Transformer Engine's fused attention "cudnn_flash_te"; here it is the same choice.
ALIASES = {"cudnn_flash_te": "cudnn_flash"}
KERNELS = ("dot_product", "cudnn_flash")
# cuDNN's fused flash attention needs Ampere (sm_80) or newer.
MIN_COMPUTE_CAPABILITY = 8.0


def causal_attention(q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array) -> jax.Array:
    """Grouped-query causal softmax attention; scores and softmax in fp32, output in q's dtype."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxMxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores_BxGxRxLxM = jnp.einsum(
        "blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxMxGxK, preferred_element_type=jnp.float32
    ) / np.sqrt(K).astype(np.float32)
    causal_LxM = jnp.tril(jnp.ones((L, k_BxMxGxK.shape[1]), dtype=bool))
    # A finite minimum (not -inf) keeps fully masked rows NaN-free; exp() of it is exactly 0.
    scores_BxGxRxLxM = jnp.where(causal_LxM, scores_BxGxRxLxM, jnp.finfo(jnp.float32).min)
    probs_BxGxRxLxM = jax.nn.softmax(scores_BxGxRxLxM, axis=-1).astype(q_BxLxHxK.dtype)
    out_BxLxGxRxK = jnp.einsum(
        "bgrlm,bmgk->blgrk", probs_BxGxRxLxM, v_BxMxGxK, preferred_element_type=jnp.float32
    )
    return out_BxLxGxRxK.reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


def cudnn_flash_attention(q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array) -> jax.Array:
    """cuDNN's fused causal attention (GQA by head groups); q, k, v in bf16."""
    return jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, is_causal=True, implementation="cudnn"
    )


ATTENTION_FNS: dict[str, Callable[..., jax.Array]] = {
    "dot_product": causal_attention,
    "cudnn_flash": cudnn_flash_attention,
}


class AttentionChoice(NamedTuple):
    kernel: str  # one of KERNELS
    reason: str


def _cudnn_unusable(device) -> str | None:
    """Why cuDNN flash attention cannot run on `device`, or None when a trial compile works."""
    if device.platform != "gpu":
        return f"no NVIDIA GPU (device platform {device.platform!r})"
    capability = getattr(device, "compute_capability", None)
    try:
        if capability is None or float(capability) < MIN_COMPUTE_CAPABILITY:
            return f"{device.device_kind} has compute capability {capability}, below {MIN_COMPUTE_CAPABILITY}"
    except ValueError:
        return f"{device.device_kind} reports compute capability {capability!r}"
    # The capability says the hardware can; a trial compile of the forward and backward says
    # this jax, cuDNN and driver can (ROCm GPUs also report platform "gpu" and fail here).
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)

    def loss(q, k, v):
        return cudnn_flash_attention(q, k, v).astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    except Exception as exc:  # noqa: BLE001  # any failure means: not here
        first_line = (str(exc).splitlines() or [""])[0][:160]
        return f"cuDNN fused attention does not compile on {device.device_kind} ({type(exc).__name__}: {first_line})"
    return None


@functools.lru_cache(maxsize=None)
def _probe(device) -> str | None:
    return _cudnn_unusable(device)


def select_attention(requested: str, device=None) -> AttentionChoice:
    """The kernel a run with `attention=requested` uses on `device` (default: the first device).

    The probe compiles a tiny cuDNN attention once per device and process; call this before
    tracing the model (build_model does) so the trial compile never happens inside a trace.
    """
    kernel = ALIASES.get(requested, requested)
    if kernel in KERNELS:
        note = f" ({requested} is MaxText's name for it)" if requested in ALIASES else ""
        return AttentionChoice(kernel, f"asked for by attention={requested}{note}")
    if kernel != "autoselected":
        raise ValueError(
            f"attention={requested!r} is not allowed: choose one of "
            f"{['autoselected', *KERNELS, *ALIASES]}"
        )
    device = jax.devices()[0] if device is None else device
    why_not = _probe(device)
    if why_not is None:
        return AttentionChoice(
            "cudnn_flash",
            f"autoselected: {device.device_kind} (compute capability {device.compute_capability}) "
            "compiles cuDNN fused attention",
        )
    return AttentionChoice("dot_product", f"autoselected: {why_not}")
