"""Ragged verify/extend attention for TPUs: Pallas kernels lowered through Mosaic, forward and backward.

Forward: grid (B, Hkv, query blocks, KV blocks), the KV axis last and sequential. The row lengths are
scalar-prefetched into SMEM, so the K/V index maps clamp the KV block index to the blocks this query block may see:
past the valid length (or before a sliding window) the block index repeats and Mosaic issues no new DMA, and the
compute is skipped. Online-softmax state lives in VMEM scratch across the KV axis; each row's log-sum-exp is written
for the backward pass. Rows pack block_q tokens x G query heads of one KV head, as in the GPU kernel.

Backward (flash-attention style): dq over a sequential KV axis with the same clamping; dk/dv over a sequential query
axis, skipping query blocks that cannot see the KV block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.layout import TileGeometry, next_pow2, pack_queries, pad_cache, unpack_output


class _Geometry(TileGeometry):
    def visible_blocks(self, length, i):
        """[first, last] KV block indices that query block i of a row with `length` valid entries may see."""
        lo, hi = self.key_range(length, i)
        last = jax.lax.div(jnp.maximum(hi, 1) - 1, self.block_k)
        return jnp.minimum(jax.lax.div(lo, self.block_k), last), last

    def scores_mask(self, length, i, j):
        """Visibility [R, block_k] of KV block j to the rows of query block i."""
        shape = (self.rows, self.block_k)
        k_pos = j * self.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        token = i * self.block_q + jax.lax.shift_right_logical(jax.lax.broadcasted_iota(jnp.int32, shape, 0),
                                                               self.group.bit_length() - 1)
        q_pos = length - self.num_q + token
        vis = k_pos < length
        if self.causal:
            vis = vis & (k_pos <= q_pos)
        if self.window:
            vis = vis & (k_pos > q_pos - self.window)
        return vis

    def kv_block(self, k_ref, v_ref, length, j):
        """K and V of block j with entries past the length zeroed (they may hold NaN)."""
        pos = j * self.block_k + jax.lax.broadcasted_iota(jnp.int32, k_ref.shape, 0)
        return jnp.where(pos < length, k_ref[...], 0), jnp.where(pos < length, v_ref[...], 0)

    def probs(self, q, k, lse, vis):
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * self.scale
        return jnp.where(vis, jnp.exp(s - lse), 0.0)


def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr, *, g: _Geometry):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]
    first, last = g.visible_blocks(length, i)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when((j >= first) & (j <= last))
    def _step():
        k, v = g.kv_block(k_ref, v_ref, length, j)
        vis = g.scores_mask(length, i, j)
        s = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(vis, s * g.scale, -jnp.inf)
        m_prev = m_scr[...]  # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        m_scr[...] = m_new
        l_scr[...] = l_scr[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        acc_scr[...] = acc_scr[...] * alpha + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr[...]
        empty = l == 0
        o_ref[...] = (acc_scr[...] / jnp.where(empty, 1.0, l)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, 0.0, m_scr[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _dq_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, *, g: _Geometry):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]
    first, last = g.visible_blocks(length, i)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when((j >= first) & (j <= last))
    def _step():
        k, v = g.kv_block(k_ref, v_ref, length, j)
        p = g.probs(q_ref[...], k, lse_ref[...], g.scores_mask(length, i, j))
        do = do_ref[...]
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        dq_scr[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32) * g.scale

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_scr, dv_scr, *,
                g: _Geometry):
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    length = lengths_ref[b]
    first, last = g.visible_blocks(length, i)

    @pl.when(i == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when((j >= first) & (j <= last))
    def _step():
        k, v = g.kv_block(k_ref, v_ref, length, j)
        q, do = q_ref[...], do_ref[...]
        p = g.probs(q, k, lse_ref[...], g.scores_mask(length, i, j))  # [R, block_k]
        t = (((0,), (0,)), ((), ()))  # contract over rows: p^T @ x
        dv_scr[...] += jax.lax.dot_general(p.astype(do.dtype), do, t, preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...])
        dk_scr[...] += jax.lax.dot_general(ds.astype(q.dtype), q, t, preferred_element_type=jnp.float32) * g.scale

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _geometry(q, k, causal, sliding_window, scale, block_k) -> _Geometry:
    B, Q, H, D = q.shape
    group = next_pow2(H // k.shape[1])
    block_q = max(next_pow2(min(Q, 128)), 8 // group, 1)  # >= 8 packed rows: a full sublane tile
    return _Geometry(Q, group, block_q, block_k, causal, sliding_window, D**-0.5 if scale is None else scale)


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


_STATIC = ("causal", "sliding_window", "scale", "block_k", "interpret")


def _block_specs(g: _Geometry, D: int):
    """BlockSpecs over the grid (b, h, query block i, KV block j): a tile of packed query rows, its per-row
    statistics, and the KV tile, whose index is clamped to the blocks row b's query block i can see, so no DMA is
    issued past a row's length or before its sliding window. The index maps take the scalar-prefetched lengths and,
    where the call has them, the cache rows (query row b reads cache row rows[b]; without them, row b)."""

    def kv_index(b, h, i, j, lens, *cache_rows):
        first, last = g.visible_blocks(lens[b], i)
        return cache_rows[0][b] if cache_rows else b, h, jnp.minimum(jnp.maximum(j, first), last), 0

    rows = pl.BlockSpec((None, None, g.rows, D), lambda b, h, i, j, *_: (b, h, i, 0))
    stat = pl.BlockSpec((None, None, g.rows, 1), lambda b, h, i, j, *_: (b, h, i, 0))
    return rows, stat, pl.BlockSpec((None, None, g.block_k, D), kv_index)


def _skip_rows_ref(kernel):
    """A kernel body for a call with cache rows: their ref arrives after the lengths', and only the index maps read
    it."""
    return lambda lengths_ref, rows_ref, *refs: kernel(lengths_ref, *refs)


@functools.partial(jax.jit, static_argnames=_STATIC)
def ragged_attention_tpu_fwd(q, k, v, lengths, *, causal=True, sliding_window=None, scale=None, block_k=128,
                             interpret=None, rows=None):
    """Forward pass: (output [B, Q, H, D], residuals for ragged_attention_tpu_bwd). `interpret`: None on a TPU, or
    a `pltpu.InterpretParams` to run under the TPU interpreter (CPU tests). rows: int32[B], the cache row each query
    row reads (the flat layout; k and v may then have any number of rows), scalar-prefetched with the lengths so the
    K/V index maps DMA that row's tiles in place: no gathered copy of the cache. Forward only: the residuals hold the
    whole cache and do not fit the backward."""
    B, Q, H, D = q.shape
    Hkv = k.shape[1]
    g = _geometry(q, k, causal, sliding_window, scale, block_k)
    qp = pack_queries(q, Hkv, g.block_q, g.group)
    kp, vp = pad_cache(k, v, block_k)
    R = g.rows
    nq, nk = qp.shape[2] // R, kp.shape[2] // block_k

    kernel = functools.partial(_forward_kernel, g=g)
    scalars = (lengths.astype(jnp.int32),)
    if rows is not None:
        kernel, scalars = _skip_rows_ref(kernel), scalars + (rows.astype(jnp.int32),)
    tile, stat, kv = _block_specs(g, D)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(qp.shape, q.dtype), jax.ShapeDtypeStruct(qp.shape[:3] + (1,), jnp.float32)],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=(B, Hkv, nq, nk), in_specs=[tile, kv, kv], out_specs=[tile, stat],
            scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                            pltpu.VMEM((R, D), jnp.float32)]),
        compiler_params=_params(),
        interpret=interpret or False,
        name="ragged_attention_tpu",
    )(*scalars, qp, kp, vp)
    return unpack_output(o, Q, H, g.group), (qp, kp, vp, scalars[0], o, lse)


@functools.partial(jax.jit, static_argnames=("num_heads",) + _STATIC)
def ragged_attention_tpu_bwd(residuals, do, *, num_heads, causal=True, sliding_window=None, scale=None, block_k=128,
                             interpret=None):
    """Backward pass: (dq, dk, dv); dk and dv cover the cache padded to a multiple of block_k."""
    qp, kp, vp, lengths, o, lse = residuals
    B, Q, _, D = do.shape
    Hkv = kp.shape[1]
    g = _geometry(do, kp, causal, sliding_window, scale, block_k)
    dop = pack_queries(do, Hkv, g.block_q, g.group)
    delta = jnp.sum(dop.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)  # [B, Hkv, rows, 1]
    R = g.rows
    nq, nk = qp.shape[2] // R, kp.shape[2] // block_k

    rows, stat, kv = _block_specs(g, D)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, g=g),
        out_shape=jax.ShapeDtypeStruct(qp.shape, qp.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, Hkv, nq, nk), in_specs=[rows, kv, kv, rows, stat, stat], out_specs=rows,
            scratch_shapes=[pltpu.VMEM((R, D), jnp.float32)]),
        compiler_params=_params(), interpret=interpret or False, name="ragged_attention_tpu_dq",
    )(lengths, qp, kp, vp, dop, lse, delta)
    # dk/dv: grid (B, Hkv, KV block j, query block i), the query axis sequential
    rows_t = pl.BlockSpec((None, None, R, D), lambda b, h, j, i, lens: (b, h, i, 0))
    stat_t = pl.BlockSpec((None, None, R, 1), lambda b, h, j, i, lens: (b, h, i, 0))
    kv_t = pl.BlockSpec((None, None, block_k, D), lambda b, h, j, i, lens: (b, h, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, g=g),
        out_shape=[jax.ShapeDtypeStruct(kp.shape, kp.dtype)] * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(B, Hkv, nk, nq), in_specs=[rows_t, kv_t, kv_t, rows_t, stat_t, stat_t],
            out_specs=[kv_t, kv_t],
            scratch_shapes=[pltpu.VMEM((block_k, D), jnp.float32), pltpu.VMEM((block_k, D), jnp.float32)]),
        compiler_params=_params(), interpret=interpret or False, name="ragged_attention_tpu_dkv",
    )(lengths, qp, kp, vp, dop, lse, delta)
    return unpack_output(dq, Q, num_heads, g.group), dk, dv


def ragged_attention_tpu(q, k, v, lengths, **kw):
    """Same contract as `ragged_attention_reference`. Forward only; `pallas_kernels.ragged_attention` adds the
    fused backward."""
    return ragged_attention_tpu_fwd(q, k, v, lengths, **kw)[0]
