"""Causal grouped-query attention kernels, and which one a run uses.

Shape letters as in `layers.py`: B batch, L query positions, M key positions, H query heads,
G key/value heads, R = H / G, K head dim.

- `dot_product`: scores and softmax in fp32, materialised per head (`[B, G, R, L, M]`), then a
  second product with V. Runs everywhere; its saved probabilities grow with L^2.
- `cudnn_flash`: cuDNN's fused attention through `jax.nn.dot_product_attention(...,
  implementation="cudnn")`: no per-head L x M tensor in memory, only the output and a
  log-sum-exp per query row are kept for the backward pass (packed rows add one `[B, 1, L, M]`
  bf16 mask bias). NVIDIA GPUs of compute capability 8.0 or newer, bf16.
- `chunked`: FlashAttention's blocked online softmax in `jax.numpy`/`lax` loops
  (`chunked_attention.py`): memory linear in L on every device, `attention_chunk_size` queries
  and keys at a time, recomputing scores in the backward pass.
- `autoselected`: `cudnn_flash` where a trial compilation of it succeeds on an NVIDIA GPU;
  elsewhere `chunked` for sequences longer than `CHUNKED_ABOVE` tokens, `dot_product` up to
  it (so short-sequence results stay bit for bit what they were). `select_attention` says
  which and why.

Every kernel has the signature `fn(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, *, segment_ids_BxL=None)`:
causal in the row's own token order, and never across segments (a query attends to keys of
its own segment id only; padding, id 0, attends to padding, whose loss weight is zero).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_jax.config.choices import ATTENTION_KERNEL_ALIASES as ALIASES
from nvfp4_jax.config.choices import RESOLVED_ATTENTION_KERNELS as KERNELS
from nvfp4_jax.model.chunked_attention import chunked_attention

# Off-GPU, autoselected keeps dot_product up to this many tokens: its fp32 scores and
# probabilities are 8 * L^2 bytes per head and row (128 MiB per head at 4096 tokens; measured
# in benchmarks/results/attention_memory.json), past which the blocked kernel's linear memory wins.
CHUNKED_ABOVE = 2048
# cuDNN's fused flash attention needs Ampere (sm_80) or newer.
MIN_COMPUTE_CAPABILITY = 8.0


def segment_mask(segment_ids_BxL: jax.Array) -> jax.Array:
    """[B, L, L] bool: query l and key m carry the same segment id."""
    return segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]


def causal_attention(
    q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array, *,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query causal softmax attention; scores and softmax in fp32, output in q's dtype."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxMxGxK.shape[2]
    q_BxLxGxRxK = q_BxLxHxK.reshape(B, L, G, H // G, K)
    scores_BxGxRxLxM = jnp.einsum(
        "blgrk,bmgk->bgrlm", q_BxLxGxRxK, k_BxMxGxK, preferred_element_type=jnp.float32
    ) / np.sqrt(K).astype(np.float32)
    causal_LxM = jnp.tril(jnp.ones((L, k_BxMxGxK.shape[1]), dtype=bool))
    if segment_ids_BxL is not None:
        causal_LxM = (causal_LxM & segment_mask(segment_ids_BxL))[:, None, None]  # B x 1 x 1 x L x M
    # A finite minimum (not -inf) keeps fully masked rows NaN-free; exp() of it is exactly 0.
    scores_BxGxRxLxM = jnp.where(causal_LxM, scores_BxGxRxLxM, jnp.finfo(jnp.float32).min)
    probs_BxGxRxLxM = jax.nn.softmax(scores_BxGxRxLxM, axis=-1).astype(q_BxLxHxK.dtype)
    out_BxLxGxRxK = jnp.einsum(
        "bgrlm,bmgk->blgrk", probs_BxGxRxLxM, v_BxMxGxK, preferred_element_type=jnp.float32
    )
    return out_BxLxGxRxK.reshape(B, L, H, K).astype(q_BxLxHxK.dtype)


def fused_api_attention(
    q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array, *,
    segment_ids_BxL: jax.Array | None = None, implementation: str = "cudnn",
) -> jax.Array:
    """`jax.nn.dot_product_attention`, causal, with segments as an explicit mask.

    jax 0.10's public API has no segment ids (its `query_seq_lengths` only pads a row's tail);
    for cuDNN it turns a boolean mask into a `[B, 1, L, M]` additive bias, applied with the
    causal mask cuDNN generates itself. `implementation="xla"` runs the same call on any device.
    """
    mask = None if segment_ids_BxL is None else segment_mask(segment_ids_BxL)[:, None]
    return jax.nn.dot_product_attention(
        q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, mask=mask, is_causal=True, implementation=implementation
    )


def cudnn_flash_attention(
    q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array, *,
    segment_ids_BxL: jax.Array | None = None,
) -> jax.Array:
    """cuDNN's fused causal attention (GQA by head groups); q, k, v in bf16."""
    return fused_api_attention(q_BxLxHxK, k_BxMxGxK, v_BxMxGxK, segment_ids_BxL=segment_ids_BxL)


def attention_fn(kernel: str, chunk_size: int) -> Callable[..., jax.Array]:
    """The kernel `fn(q, k, v, *, segment_ids_BxL=None)` of a resolved kernel name (one of
    KERNELS); `chunk_size` is the chunked kernel's block (attention_chunk_size)."""
    return KERNEL_FNS[kernel](chunk_size)


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
    # With segment ids: the masked (bias) form packed batches use is the one that must compile.
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 128), jnp.int32)

    def loss(q, k, v, seg):
        return cudnn_flash_attention(q, k, v, segment_ids_BxL=seg).astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
    except Exception as exc:  # noqa: BLE001  # any failure means: not here
        first_line = (str(exc).splitlines() or [""])[0][:160]
        return f"cuDNN fused attention does not compile on {device.device_kind} ({type(exc).__name__}: {first_line})"
    return None


@functools.lru_cache(maxsize=None)
def _probe(device) -> str | None:
    return _cudnn_unusable(device)


# Each resolved kernel name (config.choices) -> its function given attention_chunk_size.
KERNEL_FNS: dict[str, Callable[[int], Callable[..., jax.Array]]] = {
    "dot_product": lambda chunk_size: causal_attention,
    "cudnn_flash": lambda chunk_size: cudnn_flash_attention,
    "chunked": lambda chunk_size: functools.partial(chunked_attention, block_size=chunk_size),
}


def select_attention(requested: str, device=None, seq_len: int | None = None) -> AttentionChoice:
    """The kernel a run with `attention=requested` uses on `device` (default: the first device)
    for sequences of `seq_len` tokens (max_target_length; None: short).

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
    if seq_len is not None and seq_len > CHUNKED_ABOVE:
        return AttentionChoice(
            "chunked", f"autoselected: {why_not}; {seq_len} tokens > {CHUNKED_ABOVE}, memory linear in L"
        )
    return AttentionChoice("dot_product", f"autoselected: {why_not}")
