"""Ragged verify/extend attention for GPUs: Pallas kernels lowered through Triton, forward and backward.

Forward: grid (B, Hkv, query blocks). One program holds the packed rows (block_q tokens x G heads) of one KV head and
walks the row's visible KV range in block_k tiles with an online softmax, also writing each row's log-sum-exp for
the backward pass. The loop bounds come from the row's length (read from a tensor: GPU backends have no scalar
prefetch), so tiles past the valid length or before a sliding window are never loaded. Keys and values past the
length are zeroed before use (stale cache entries may hold NaN).

Backward (flash-attention style, from the saved log-sum-exp): one kernel per query block accumulates dq over the KV
tiles it sees; one kernel per KV tile accumulates dk and dv over all query blocks, so no [T, S] matrix is stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.layout import TileGeometry, next_pow2, pack_queries, pad_cache, unpack_output

MAX_ROWS = 64  # packed query rows per tile


class _Geometry(TileGeometry):
    def row_positions(self, length, qb):
        """Absolute positions of the tile's rows, and the key range [lo, hi) the tile may see."""
        token = qb * self.block_q + jax.lax.shift_right_logical(
            jax.lax.broadcasted_iota(jnp.int32, (self.rows,), 0), self.group.bit_length() - 1)
        return (length - self.num_q + token, *self.key_range(length, qb))

    def visible(self, q_pos, k_pos, length):
        vis = (k_pos < length)[None, :]
        if self.causal:
            vis = vis & (k_pos[None, :] <= q_pos[:, None])
        if self.window:
            vis = vis & (k_pos[None, :] > q_pos[:, None] - self.window)
        return vis

    def kv_tile(self, k_ref, v_ref, j, length):
        start = j * self.block_k
        k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (self.block_k,), 0)
        valid = (k_pos < length)[:, None]
        k = jnp.where(valid, k_ref[pl.ds(start, self.block_k), :], 0)
        v = jnp.where(valid, v_ref[pl.ds(start, self.block_k), :], 0)
        return k, v, k_pos


def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, g: _Geometry):
    b, qb = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]  # [R, D]
    q_pos, lo, hi = g.row_positions(length, qb)

    def body(j, carry):
        m, l, acc = carry
        k, v, k_pos = g.kv_tile(k_ref, v_ref, j, length)
        vis = g.visible(q_pos, k_pos, length)
        s = jnp.where(vis, pltriton.dot(q, k.T).astype(jnp.float32) * g.scale, -jnp.inf)  # [R, block_k]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        p = jnp.where(vis, jnp.exp(s - m_safe[:, None]), 0.0)
        alpha = jnp.exp(m - m_safe)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((g.rows,), -jnp.inf, jnp.float32), jnp.zeros((g.rows,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, l, acc = jax.lax.fori_loop(jax.lax.div(lo, g.block_k), jax.lax.div(hi + g.block_k - 1, g.block_k), body, init)
    empty = l == 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))


def _probs(g: _Geometry, q, k, k_pos, q_pos, lse, length):
    vis = g.visible(q_pos, k_pos, length)
    s = pltriton.dot(q, k.T).astype(jnp.float32) * g.scale
    return jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, g: _Geometry):
    b, qb = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos, lo, hi = g.row_positions(length, qb)

    def body(j, dq):
        k, v, k_pos = g.kv_tile(k_ref, v_ref, j, length)
        p = _probs(g, q, k, k_pos, q_pos, lse, length)
        ds = p * (pltriton.dot(do, v.T).astype(jnp.float32) - delta[:, None])
        return dq + pltriton.dot(ds.astype(k.dtype), k).astype(jnp.float32) * g.scale

    dq = jax.lax.fori_loop(jax.lax.div(lo, g.block_k), jax.lax.div(hi + g.block_k - 1, g.block_k), body,
                           jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, g: _Geometry,
                num_q_blocks: int):
    b, j = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    k, v, k_pos = g.kv_tile(k_ref, v_ref, j, length)

    def body(qb, carry):
        dk, dv = carry
        rows = pl.ds(qb * g.rows, g.rows)
        q, do, lse, delta = q_ref[rows, :], do_ref[rows, :], lse_ref[rows], delta_ref[rows]
        q_pos, _, _ = g.row_positions(length, qb)
        p = _probs(g, q, k, k_pos, q_pos, lse, length)  # [R, block_k]
        dv = dv + pltriton.dot(p.T.astype(do.dtype), do).astype(jnp.float32)
        ds = p * (pltriton.dot(do, v.T).astype(jnp.float32) - delta[:, None])
        return dk + pltriton.dot(ds.T.astype(q.dtype), q).astype(jnp.float32) * g.scale, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, num_q_blocks, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _geometry(q, k, causal, sliding_window, scale, block_k) -> _Geometry:
    B, Q, H, D = q.shape
    group = next_pow2(H // k.shape[1])
    # 16..64 packed rows per tile: 16 is Triton's smallest dot; more rows overflow shared memory in the backward
    # kernels (float32, long training sequences).
    block_q = max(min(next_pow2(min(Q, 64)), MAX_ROWS // group), 16 // group, 1)
    return _Geometry(Q, group, block_q, block_k, causal, sliding_window, D**-0.5 if scale is None else scale)


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, num_warps, num_stages, name):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          interpret=interpret, name=name)


_STATIC = ("causal", "sliding_window", "scale", "block_k", "interpret", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_attention_gpu_fwd(q, k, v, lengths, *, causal=True, sliding_window=None, scale=None, block_k=64,
                             interpret=False, num_warps=4, num_stages=2):
    """Forward pass: (output [B, Q, H, D], residuals for ragged_attention_gpu_bwd)."""
    B, Q, H, D = q.shape
    Hkv = k.shape[1]
    g = _geometry(q, k, causal, sliding_window, scale, block_k)
    qp = pack_queries(q, Hkv, g.block_q, g.group)
    kp, vp = pad_cache(k, v, block_k)
    R, S, rows = g.rows, kp.shape[2], qp.shape[2]
    tile = pl.BlockSpec((None, None, R, D), lambda b, h, i: (b, h, i, 0))
    cache = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, h, 0, 0))
    o, lse = _call(functools.partial(_forward_kernel, g=g), (B, Hkv, rows // R),
                   [pl.BlockSpec((B,), lambda b, h, i: (0,)), tile, cache, cache],
                   [tile, pl.BlockSpec((None, None, R), lambda b, h, i: (b, h, i))],
                   [jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct((B, Hkv, rows), jnp.float32)],
                   interpret, num_warps, num_stages, "ragged_attention_gpu")(lengths.astype(jnp.int32), qp, kp, vp)
    return unpack_output(o, Q, H, g.group), (qp, kp, vp, lengths.astype(jnp.int32), o, lse)


@functools.partial(jax.jit, static_argnames=("num_heads",) + _STATIC)
def ragged_attention_gpu_bwd(residuals, do, *, num_heads, causal=True, sliding_window=None, scale=None, block_k=64,
                             interpret=False, num_warps=4, num_stages=2):
    """Backward pass: (dq, dk, dv) for the cotangent `do` [B, Q, H, D] of the forward output. dk and dv cover the
    cache padded to a multiple of block_k; slice them to the original length."""
    qp, kp, vp, lengths, o, lse = residuals
    B, Q, _, D = do.shape
    Hkv, S = kp.shape[1], kp.shape[2]
    g = _geometry(do, kp, causal, sliding_window, scale, block_k)
    dop = pack_queries(do, Hkv, g.block_q, g.group)
    delta = jnp.sum(dop.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, Hkv, rows]
    R, rows = g.rows, qp.shape[2]
    lens = pl.BlockSpec((B,), lambda b, h, i: (0,))
    tile = pl.BlockSpec((None, None, R, D), lambda b, h, i: (b, h, i, 0))
    row_stat = pl.BlockSpec((None, None, R), lambda b, h, i: (b, h, i))
    cache = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, h, 0, 0))
    dq = _call(functools.partial(_dq_kernel, g=g), (B, Hkv, rows // R),
               [lens, tile, cache, cache, tile, row_stat, row_stat], tile,
               jax.ShapeDtypeStruct(qp.shape, qp.dtype), interpret, num_warps, num_stages,
               "ragged_attention_gpu_dq")(lengths, qp, kp, vp, dop, lse, delta)
    all_rows = pl.BlockSpec((None, None, rows, D), lambda b, h, j: (b, h, 0, 0))
    all_stats = pl.BlockSpec((None, None, rows), lambda b, h, j: (b, h, 0))
    kv_tile = pl.BlockSpec((None, None, block_k, D), lambda b, h, j: (b, h, j, 0))
    dk, dv = _call(functools.partial(_dkv_kernel, g=g, num_q_blocks=rows // R), (B, Hkv, S // block_k),
                   [lens, all_rows, cache, cache, all_rows, all_stats, all_stats], [kv_tile, kv_tile],
                   [jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2, interpret, num_warps, num_stages,
                   "ragged_attention_gpu_dkv")(lengths, qp, kp, vp, dop, lse, delta)
    return unpack_output(dq, Q, num_heads, g.group), dk, dv


def ragged_attention_gpu(q, k, v, lengths, **kw):
    """Same contract as `ragged_attention_reference`: q [B, Q, H, D], k/v [B, Hkv, S, D], lengths int32[B] (valid
    entries including the Q new tokens). Forward only; `pallas_kernels.ragged_attention` adds the fused backward."""
    return ragged_attention_gpu_fwd(q, k, v, lengths, **kw)[0]
