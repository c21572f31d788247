"""Token selection: greedy, or sampling after temperature, top-k and top-p processing, with per-row RNG keys."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specformer_jax.errors import SpecformerError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise SpecformerError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecformerError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecformerError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Logits of the distribution actually sampled from: scaled by 1/T, outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        desc = -jnp.sort(-logits, axis=-1)
        p = jax.nn.softmax(desc, axis=-1)
        keep = jnp.cumsum(p, axis=-1) - p < cfg.top_p  # smallest prefix whose mass reaches top_p
        cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def select_tokens(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """logits [B, V] -> int32[B]; keys: one PRNG key per row (unused when greedy)."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    processed = process_logits(logits, cfg)
    return jax.vmap(jax.random.categorical)(keys, processed).astype(jnp.int32)


def step_keys(row_keys: jax.Array, step: jax.Array) -> jax.Array:
    """Independent key per row and step, so a row's samples do not depend on what else is in the batch."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, step)
