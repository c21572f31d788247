"""Pure-jnp reference for ragged attention of new query tokens against a per-row KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_attention_reference(q, k, v, lengths, *, causal=True, sliding_window=None, scale=None, rows=None):
    """Attention of Q new tokens per row against a KV cache with per-row valid lengths.

    q: [B, Q, H, D]; k, v: [B', Hkv, S, D] with B' >= B, row b of q against row b of k and v (a cache may hold
    more rows than a call decodes: a pool's first B rows) and H a multiple of Hkv; lengths: int32[B], the number of
    valid cache entries per row *including* the Q new tokens, which sit at positions lengths[b] - Q + t.
    causal=True: token t sees keys < lengths[b] - Q + t + 1. causal=False: it sees keys < lengths[b]
    (bidirectional inside the appended block). Entries at or beyond lengths[b] are never read, NaN included.
    Returns [B, Q, H, D] in q's dtype; softmax in float32.
    rows: int32[B], the cache row each query row reads (default: row b reads row b). Several query rows may read
    one cache row: the flat layout of a verify pass, one query token per row (Q = 1) and a request's positions on
    rows of their own, each with the length it sees (its cache and the positions before it in the round).
    """
    B, Q, H, D = q.shape
    k, v = (k[:B], v[:B]) if rows is None else (k[rows], v[rows])
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = D**-0.5 if scale is None else scale
    q_pos = lengths[:, None] - Q + jnp.arange(Q)[None, :]  # [B, Q]
    k_pos = jnp.arange(S)
    valid = k_pos[None, :] < lengths[:, None]  # [B, S]
    visible = jnp.broadcast_to(valid[:, None, :], (B, Q, S))
    if causal:
        visible = visible & (k_pos[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        visible = visible & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
    # Garbage keys are removed by the score mask; garbage values must be zeroed, or NaN would leak through 0 * NaN.
    v = jnp.where(valid[:, None, :, None], v, 0)
    qg = q.reshape(B, Q, Hkv, G, D)
    s = jnp.einsum("bqkgd,bksd->bkgqs", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None, None, :, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(visible[:, None, None, :, :], p, 0.0)  # rows with no visible key give 0, not NaN
    # Batched over (b, k) with the output in the same order: asked for [B, Q, Hkv, G, D] directly, XLA's CPU backend
    # lays the product out transposed and runs it as a slow generic dot, not as a fast batched matmul.
    o = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.transpose(0, 3, 1, 2, 4).reshape(B, Q, H, D).astype(q.dtype)
