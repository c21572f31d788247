"""Explicit KV cache pytree with per-row lengths (no shared write cursor, so rows can advance raggedly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import cache_block


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, S, D]
    v: jax.Array  # [L, B, Hkv, S, D]
    lengths: jax.Array  # int32[B]: valid entries per row; everything at or past it is garbage, never read

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, num_layers, batch, max_len, num_kv_heads, head_dim, dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    def write_rows(self, new: "KVCache", slots: jax.Array, lens: jax.Array, Tp: int) -> "KVCache":
        """The first Tp positions of a b-row cache written into rows `slots` (int32[b]; an index past the rows
        drops that row), their lengths set to `lens`."""
        at = (slice(None), slots, slice(None), slice(0, Tp))
        return KVCache(self.k.at[at].set(new.k[:, :, :, :Tp], mode="drop"),
                       self.v.at[at].set(new.v[:, :, :, :Tp], mode="drop"),
                       self.lengths.at[slots].set(lens, mode="drop"))


def target_cache(cfg, batch: int, max_len: int, num_layers: int | None = None) -> KVCache:
    """A zeroed cache for `cfg` (a TargetConfig) holding at least max_len positions: rounded up to the attention
    kernel's tile, so the kernel never pads it. num_layers: default cfg.num_layers (the drafter's cache has 1)."""
    block = cache_block(cfg.attention_impl, cfg.head_dim)
    size = -(-max_len // block) * block
    layers = cfg.num_layers if num_layers is None else num_layers
    return KVCache.zeros(layers, batch, size, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)


def write_tokens(cache: jax.Array, layer, new: jax.Array, start: jax.Array, rows: jax.Array | None = None):
    """Scatter new [B, T, Hkv, D] into the stacked cache [L, B', Hkv, S, D] at (layer, per-row offsets start[B]),
    row b into cache row rows[b] (default b; the flat layout of a verify pass, modeling/target.py).

    Only the new rows are written (in place inside loops). Positions past the end are dropped: the padding of a
    ragged prefill may run past the cache, and a flat pass's padding is placed there.
    """
    B, T = new.shape[:2]
    pos = start[:, None] + jnp.arange(T)[None, :]  # [B, T]
    b = (jnp.arange(B) if rows is None else rows)[:, None]
    return cache.at[layer, b, :, pos, :].set(new.astype(cache.dtype), mode="drop")
