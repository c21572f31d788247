"""Ragged verify/extend attention for GPUs: Pallas kernels lowered through Triton, forward and backward.

Forward: grid (B, Hkv, query blocks[, KV splits]). One program holds the packed rows (block_q tokens x G heads) of
one KV head and walks the row's visible KV range in block_k tiles with an online softmax, also writing each row's
log-sum-exp for the backward pass. The loop bounds come from the row's length (read from a tensor: GPU backends have
no scalar prefetch), so tiles past the valid length or before a sliding window are never loaded. Keys and values past
the length are zeroed before use (stale cache entries may hold NaN). With few rows (small batches) that grid leaves
most of the GPU idle, so the visible range is split across `num_splits` programs ("flash-decoding"); each writes its
partial output and log-sum-exp, and XLA merges them.

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
TARGET_PROGRAMS = 256  # about two programs per SM on an H100 (132 SMs)
MIN_SPLIT_TILES = 2  # KV tiles per split, at least: fewer and the per-program cost and the merge dominate


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

    def kv_tile(self, k_ref, v_ref, j, length, row=None):
        """Tile j of K and V, zeroed past the length; row: the cache row to read where the refs hold every row of
        the cache [B', S, D] (a call with rows), else the refs are one row's [S, D]."""
        start = j * self.block_k
        k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (self.block_k,), 0)
        valid = (k_pos < length)[:, None]
        at = (pl.ds(start, self.block_k), slice(None))
        at = at if row is None else (row, *at)  # one indexer: the Triton lowering takes no chained ones
        k = jnp.where(valid, k_ref[at], 0)
        v = jnp.where(valid, v_ref[at], 0)
        return k, v, k_pos


def _forward_kernel(lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, g: _Geometry, num_splits: int, row=None):
    b, qb = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    q = q_ref[...]  # [R, D]
    q_pos, lo, hi = g.row_positions(length, qb)

    def body(j, carry):
        m, l, acc = carry
        k, v, k_pos = g.kv_tile(k_ref, v_ref, j, length, row)
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
    first, last = jax.lax.div(lo, g.block_k), jax.lax.div(hi + g.block_k - 1, g.block_k)
    if num_splits > 1:  # each split takes its share of the visible tiles [first, last) (none: an empty split)
        split, n = pl.program_id(3), jnp.maximum(last - first, 0)
        first, last = first + jax.lax.div(n * split, num_splits), first + jax.lax.div(n * (split + 1), num_splits)
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    empty = l == 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    # A split that saw nothing must get no weight in the merge: -inf; the whole range empty gives lse 0 as before.
    lse_ref[...] = jnp.where(empty, 0.0 if num_splits == 1 else -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _rows_forward_kernel(rows_ref, lengths_ref, *refs, **kw):
    """The forward kernel of a call with cache rows: k_ref and v_ref hold one KV head of the whole cache [B', S, D]
    and query row b reads its row rows[b] (the Triton backend has no scalar prefetch for the index maps to read)."""
    _forward_kernel(lengths_ref, *refs, row=rows_ref[pl.program_id(0)], **kw)


def _merge_splits(o, lse):
    """Combine the splits' normalized outputs o [B, Hkv, N, rows, D] and log-sum-exps lse [B, Hkv, N, rows] (-inf:
    the split saw nothing) into the output and lse of one pass over the whole range (0 and 0 where nothing is
    visible at all)."""
    m = jnp.max(lse, axis=2)
    # decode_attention.py needs this barrier on the split maxima to avoid NaN after JIT (b/389925439); it is cheap.
    m = jax.lax.optimization_barrier(jnp.where(m == -jnp.inf, 0.0, m))
    w = jnp.exp(lse - m[:, :, None])  # [B, Hkv, N, rows]; 0 for empty splits
    total = jnp.sum(w, axis=2)
    empty = total == 0
    out = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=2) / jnp.where(empty, 1.0, total)[..., None]
    return out.astype(o.dtype), jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, total)))


def auto_num_splits(batch: int, kv_heads: int, q_blocks: int, kv_tiles: int) -> int:
    """Splits of the KV range per (row, KV head, query block) when the caller gives none: enough that the grid has
    about TARGET_PROGRAMS programs, but at least MIN_SPLIT_TILES tiles of the (padded) cache per split, and 1 when
    the grid is already that large (batch 64 x 8 KV heads: splitting would only add the merge)."""
    programs = max(batch * kv_heads * q_blocks, 1)
    return max(1, min(-(-TARGET_PROGRAMS // programs), kv_tiles // MIN_SPLIT_TILES))


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


def _geometry(q, k, causal, sliding_window, scale, block_k) -> _Geometry:  # q, k: arrays or shapes
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


def num_splits_for(q, k, *, block_k=64) -> int:
    """The split count ragged_attention_gpu_fwd picks by itself for q [B, Q, H, D] and k [B, Hkv, S, D] (arrays or
    ShapeDtypeStructs)."""
    g = _geometry(q, k, True, None, None, block_k)
    q_blocks = -(-q.shape[1] // g.block_q)
    return auto_num_splits(q.shape[0], k.shape[1], q_blocks, -(-k.shape[2] // block_k))


@functools.partial(jax.jit, static_argnames=_STATIC + ("num_splits",))
def ragged_attention_gpu_fwd(q, k, v, lengths, *, causal=True, sliding_window=None, scale=None, block_k=64,
                             interpret=False, num_warps=4, num_stages=2, num_splits=None, rows=None):
    """Forward pass: (output [B, Q, H, D], residuals for ragged_attention_gpu_bwd). num_splits: programs per
    (row, KV head, query block), each over its share of the visible KV tiles; None picks `auto_num_splits`. The
    residuals are the same whatever the split count. rows: int32[B], the cache row each query row reads (the flat
    layout; k and v may then have any number of rows), read in the kernel: no gathered copy of the cache. Forward
    only: the residuals hold the whole cache and do not fit the backward."""
    B, Q, H, D = q.shape
    Hkv = k.shape[1]
    g = _geometry(q, k, causal, sliding_window, scale, block_k)
    qp = pack_queries(q, Hkv, g.block_q, g.group)
    kp, vp = pad_cache(k, v, block_k)
    cache_rows = rows  # `rows` is the packed query rows' count below
    R, S, rows = g.rows, kp.shape[2], qp.shape[2]
    N = num_splits_for(q, k, block_k=block_k) if num_splits is None else num_splits
    if N < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    lens = lengths.astype(jnp.int32)
    # With splits, the outputs gain a split axis: each split's normalized output (in q's dtype, as decode_attention.py
    # does: half the extra traffic of float32 at bfloat16) and lse, merged below. One split is the plain kernel.
    split = (N,) if N > 1 else ()
    squeezed = (None,) * (2 + len(split))
    tile = pl.BlockSpec((None, None, R, D), lambda b, h, i, *s: (b, h, i, 0))
    cache = pl.BlockSpec((None, None, S, D), lambda b, h, i, *s: (b, h, 0, 0))
    kernel, scalars = _forward_kernel, (lens,)
    if cache_rows is not None:  # every row of the cache, one KV head's
        cache = pl.BlockSpec((kp.shape[0], None, S, D), lambda b, h, i, *s: (0, h, 0, 0))
        kernel, scalars = _rows_forward_kernel, (cache_rows.astype(jnp.int32), lens)
    name = "ragged_attention_gpu_split" if split else "ragged_attention_gpu"
    o, lse = _call(functools.partial(kernel, g=g, num_splits=N), (B, Hkv, rows // R, *split),
                   [pl.BlockSpec((B,), lambda *_: (0,))] * len(scalars) + [tile, cache, cache],
                   [pl.BlockSpec((*squeezed, R, D), lambda b, h, i, *s: (b, h, *s, i, 0)),
                    pl.BlockSpec((*squeezed, R), lambda b, h, i, *s: (b, h, *s, i))],
                   [jax.ShapeDtypeStruct((B, Hkv, *split, rows, D), q.dtype),
                    jax.ShapeDtypeStruct((B, Hkv, *split, rows), jnp.float32)],
                   interpret, num_warps, num_stages, name)(*scalars, qp, kp, vp)
    if split:
        o, lse = _merge_splits(o, lse)
    return unpack_output(o, Q, H, g.group), (qp, kp, vp, lens, o, lse)


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
