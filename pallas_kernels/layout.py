"""Row packing shared by the kernels: the G query heads of one KV head and a block of query tokens form the rows of
one tile, so every KV tile is read once per KV head (GQA) and the verify step's few tokens still fill a matmul."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pack_queries(q, num_kv_heads: int, block_q: int, group_pad: int):
    """q [B, Q, H, D] -> [B, Hkv, Qp * Gp, D], rows ordered (token, head in group); Q padded to a multiple of
    block_q and the group G = H / Hkv to group_pad (padding rows are zeros and are dropped by unpack_output)."""
    B, Q, H, D = q.shape
    G = H // num_kv_heads
    Qp = -(-Q // block_q) * block_q
    x = q.reshape(B, Q, num_kv_heads, G, D)
    x = jnp.pad(x, ((0, 0), (0, Qp - Q), (0, 0), (0, group_pad - G), (0, 0)))
    return x.transpose(0, 2, 1, 3, 4).reshape(B, num_kv_heads, Qp * group_pad, D)


def unpack_output(o, Q: int, H: int, group_pad: int):
    """Inverse of pack_queries: [B, Hkv, Qp * Gp, D] -> [B, Q, H, D]."""
    B, Hkv, R, D = o.shape
    G = H // Hkv
    o = o.reshape(B, Hkv, R // group_pad, group_pad, D)[:, :, :Q, :G]
    return o.transpose(0, 2, 1, 3, 4).reshape(B, Q, H, D)


def pad_cache(k, v, block_k: int):
    """Pad the cache's sequence axis to a multiple of block_k (a copy: allocate caches aligned to avoid it)."""
    S = k.shape[2]
    pad = -S % block_k
    if pad:
        widths = ((0, 0), (0, 0), (0, pad), (0, 0))
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    return k, v


@dataclasses.dataclass(frozen=True)
class TileGeometry:
    """How a row's Q new tokens are tiled: query blocks of block_q tokens x group heads (= rows), KV tiles of block_k
    positions, and the mask (causal with offset or bidirectional, optional sliding window)."""

    num_q: int  # real query tokens per row
    group: int  # query heads per KV head, padded to a power of two
    block_q: int  # query tokens per tile; rows per tile = block_q * group
    block_k: int
    causal: bool
    window: int | None
    scale: float

    @property
    def rows(self) -> int:
        return self.block_q * self.group

    def key_range(self, length, qb):
        """[lo, hi): the key positions that query block qb of a row with `length` valid entries may see (its new
        tokens sit at positions length - num_q + t)."""
        first = length - self.num_q + qb * self.block_q
        hi = jnp.minimum(length, first + self.block_q) if self.causal else length
        lo = jnp.maximum(first - self.window + 1, 0) if self.window else 0
        return lo, hi
