"""Causal, segment-aware GQA attention by blocks of queries and keys: memory linear in L.

FlashAttention's algorithm (Dao et al. 2022; the FA-2 backward) in `jax.numpy` and `lax`
loops, so it runs on every device. Shape letters as in `attention.py`, plus N blocks of C
positions each (`Lp = N * C`, the length padded up to whole blocks).

Forward: for each query block i, a loop over key blocks j = 0..i only (blocks above the
diagonal are never visited) keeps a running maximum `m`, a running sum `l` and an unnormalised
output, all fp32 ("online softmax"). It saves q, k, v, the output and the log-sum-exp per query
row; no `C x C` score block outlives its loop iteration.

Backward (custom VJP): the scores are recomputed block by block from q, k and the saved
log-sum-exp. One pass over query blocks accumulates dQ (key blocks 0..i), one over key blocks
accumulates dK and dV (query blocks j..N-1); `D = rowsum(dO * O)` replaces the softmax's
Jacobian. K/V heads are never repeated: each of the G key/value heads meets its R query heads
inside the einsums.

Padding to whole blocks needs no mask of its own: a padded key sits after every real query,
so causality already hides it, and a padded query (dropped from the output) sees at least
itself, so no row is ever empty.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Masked scores: finite, so that a row whose block is all masked keeps a finite running
# maximum (exp(min - max) is exactly 0, never NaN); masked probabilities are zeroed explicitly.
_MASKED = float(np.finfo(np.float32).min)


def _block_mask(i, j, C, seg_q_BxC, seg_k_BxC):
    """[B, 1, 1, C, C]: key position <= query position, and the same segment."""
    q_pos_C = i * C + jnp.arange(C)
    k_pos_C = j * C + jnp.arange(C)
    causal_CxC = q_pos_C[:, None] >= k_pos_C[None, :]
    same_BxCxC = seg_q_BxC[:, :, None] == seg_k_BxC[:, None, :]
    return (causal_CxC & same_BxCxC)[:, None, None]


def _scores(q_BxCxGxRxK, k_BxCxGxK, scale):
    # Same order of operations as dot_product: an fp32 product, then the division.
    return jnp.einsum("bcgrk,bdgk->bgrcd", q_BxCxGxRxK, k_BxCxGxK,
                      preferred_element_type=jnp.float32) / scale


def _take(x, n):
    return jax.lax.dynamic_index_in_dim(x, n, axis=1, keepdims=False)


def _forward(q_BxNxCxGxRxK, k_BxNxCxGxK, v_BxNxCxGxK, seg_BxNxC):
    B, N, C, G, R, K = q_BxNxCxGxRxK.shape
    scale = np.sqrt(K).astype(np.float32)

    def query_block(i):
        q_i = _take(q_BxNxCxGxRxK, i)
        seg_i = _take(seg_BxNxC, i)

        def key_block(j, carry):
            acc_BxGxRxCxK, m_BxGxRxC, l_BxGxRxC = carry
            k_j, v_j = _take(k_BxNxCxGxK, j), _take(v_BxNxCxGxK, j)
            mask = _block_mask(i, j, C, seg_i, _take(seg_BxNxC, j))
            s_BxGxRxCxC = jnp.where(mask, _scores(q_i, k_j, scale), _MASKED)
            m_new = jnp.maximum(m_BxGxRxC, s_BxGxRxCxC.max(-1))
            p_BxGxRxCxC = jnp.where(mask, jnp.exp(s_BxGxRxCxC - m_new[..., None]), 0.0)
            correction = jnp.exp(m_BxGxRxC - m_new)
            l_new = l_BxGxRxC * correction + p_BxGxRxCxC.sum(-1)
            pv_BxGxRxCxK = jnp.einsum("bgrcd,bdgk->bgrck", p_BxGxRxCxC.astype(v_j.dtype), v_j,
                                      preferred_element_type=jnp.float32)
            return acc_BxGxRxCxK * correction[..., None] + pv_BxGxRxCxK, m_new, l_new

        init = (jnp.zeros((B, G, R, C, K), jnp.float32),
                jnp.full((B, G, R, C), _MASKED, jnp.float32),
                jnp.zeros((B, G, R, C), jnp.float32))
        # j <= i: the causal blocks only. Block 0 runs before the loop, so the loop's carry is
        # typed like the blocks it accumulates (inside Ulysses' shard_map: varying over the mesh).
        acc, m, l = jax.lax.fori_loop(1, i + 1, key_block, key_block(0, init))
        out_BxCxGxRxK = jnp.einsum("bgrck->bcgrk", acc / l[..., None]).astype(q_i.dtype)
        return out_BxCxGxRxK, m + jnp.log(l)

    out_NxBxCxGxRxK, lse_NxBxGxRxC = jax.lax.map(query_block, jnp.arange(N))
    return jnp.moveaxis(out_NxBxCxGxRxK, 0, 1), jnp.moveaxis(lse_NxBxGxRxC, 0, 1)


@jax.custom_vjp
def _blocked_attention(q_BxNxCxGxRxK, k_BxNxCxGxK, v_BxNxCxGxK, seg_BxNxC):
    return _forward(q_BxNxCxGxRxK, k_BxNxCxGxK, v_BxNxCxGxK, seg_BxNxC)[0]


def _blocked_fwd(q, k, v, seg):
    out, lse = _forward(q, k, v, seg)
    return out, (q, k, v, seg, out, lse)


def _blocked_bwd(residuals, dout_BxNxCxGxRxK):
    q_BxNxCxGxRxK, k_BxNxCxGxK, v_BxNxCxGxK, seg_BxNxC, out, lse_BxNxGxRxC = residuals
    B, N, C, G, R, K = q_BxNxCxGxRxK.shape
    scale = np.sqrt(K).astype(np.float32)
    dout = dout_BxNxCxGxRxK.astype(q_BxNxCxGxRxK.dtype)
    # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: the softmax Jacobian's diagonal term.
    delta_BxNxGxRxC = jnp.einsum("bncgrk,bncgrk->bngrc", dout.astype(jnp.float32),
                                 out.astype(jnp.float32))

    def probs_and_dscores(i, j):
        """P_ij recomputed from the saved log-sum-exp, and dS_ij = P * (dP - D)."""
        q_i, k_j, v_j = _take(q_BxNxCxGxRxK, i), _take(k_BxNxCxGxK, j), _take(v_BxNxCxGxK, j)
        mask = _block_mask(i, j, C, _take(seg_BxNxC, i), _take(seg_BxNxC, j))
        s_BxGxRxCxC = _scores(q_i, k_j, scale)
        p = jnp.where(mask, jnp.exp(s_BxGxRxCxC - _take(lse_BxNxGxRxC, i)[..., None]), 0.0)
        dp = jnp.einsum("bcgrk,bdgk->bgrcd", _take(dout, i), v_j, preferred_element_type=jnp.float32)
        ds = p * (dp - _take(delta_BxNxGxRxC, i)[..., None])
        return p, ds

    def dq_block(i):
        def step(j, dq_BxCxGxRxK):
            _, ds = probs_and_dscores(i, j)
            k_j = _take(k_BxNxCxGxK, j)
            return dq_BxCxGxRxK + jnp.einsum("bgrcd,bdgk->bcgrk", ds.astype(k_j.dtype), k_j,
                                             preferred_element_type=jnp.float32)

        dq = jax.lax.fori_loop(1, i + 1, step, step(0, jnp.zeros((B, C, G, R, K), jnp.float32)))
        return (dq / scale).astype(q_BxNxCxGxRxK.dtype)

    def dkv_block(j):
        def step(i, carry):
            dk_BxCxGxK, dv_BxCxGxK = carry
            p, ds = probs_and_dscores(i, j)
            q_i, do_i = _take(q_BxNxCxGxRxK, i), _take(dout, i)
            dv = jnp.einsum("bgrcd,bcgrk->bdgk", p.astype(do_i.dtype), do_i,
                            preferred_element_type=jnp.float32)
            dk = jnp.einsum("bgrcd,bcgrk->bdgk", ds.astype(q_i.dtype), q_i,
                            preferred_element_type=jnp.float32)
            return dk_BxCxGxK + dk, dv_BxCxGxK + dv

        zeros = jnp.zeros((B, C, G, K), jnp.float32)
        dk, dv = jax.lax.fori_loop(j + 1, N, step, step(j, (zeros, zeros)))  # i >= j: the causal blocks only
        return (dk / scale).astype(k_BxNxCxGxK.dtype), dv.astype(v_BxNxCxGxK.dtype)

    dq_NxBxCxGxRxK = jax.lax.map(dq_block, jnp.arange(N))
    dk_NxBxCxGxK, dv_NxBxCxGxK = jax.lax.map(dkv_block, jnp.arange(N))
    first = functools.partial(jnp.moveaxis, source=0, destination=1)
    return first(dq_NxBxCxGxRxK), first(dk_NxBxCxGxK), first(dv_NxBxCxGxK), None


_blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)


def chunked_attention(
    q_BxLxHxK: jax.Array, k_BxMxGxK: jax.Array, v_BxMxGxK: jax.Array, *,
    segment_ids_BxL: jax.Array | None = None, block_size: int,
) -> jax.Array:
    """Causal GQA attention, never across segments, `block_size` queries and keys at a time.

    Self-attention (M = L). Any L: the sequence is padded up to whole blocks inside, and a block
    is never longer than L. Scores, softmax statistics and accumulation in fp32; output and
    gradients in q's dtype.
    """
    B, L, H, K = q_BxLxHxK.shape
    M, G = k_BxMxGxK.shape[1], k_BxMxGxK.shape[2]
    if M != L:
        raise ValueError(f"chunked attention is self-attention: {L} queries but {M} keys")
    C = min(block_size, L)
    N = -(-L // C)
    pad = N * C - L
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((B, L), jnp.int32)
    seg_BxNxC = jnp.pad(segment_ids_BxL.astype(jnp.int32), ((0, 0), (0, pad)),
                        constant_values=-1).reshape(B, N, C)

    def blocks(x, *inner):
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(B, N, C, *inner)

    out = _blocked_attention(blocks(q_BxLxHxK, G, H // G, K), blocks(k_BxMxGxK, G, K),
                             blocks(v_BxMxGxK, G, K), seg_BxNxC)
    return out.reshape(B, N * C, H, K)[:, :L]
