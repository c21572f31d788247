"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) as a functional Flax module.

One call serves prefill and multi-token extension: the T new tokens of row b are written to the KV cache at
positions cache.lengths[b] .. cache.lengths[b] + T - 1 and attend causally to everything before them.
Layers run under `nn.scan` (stacked parameters, one compiled layer body), which keeps compile time flat in depth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from pallas_kernels import ragged_attention
from specformer_jax.config import TargetConfig
from specformer_jax.modeling.kv_cache import KVCache, write_tokens
from specformer_jax.modeling.layers import RMSNorm, SwiGLU, rope


def _dense(features, cfg: TargetConfig, name, bias=False):
    return nn.Dense(features, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype, name=name)


class Attention(nn.Module):
    """GQA self-attention that appends its keys/values to one layer of the cache before attending."""

    cfg: TargetConfig

    @nn.compact
    def __call__(self, x, positions, k_all, v_all, layer, start, kv_len):
        """Appends this layer's keys/values to the stacked caches [L, B, Hkv, S, D] at `layer`; returns them too."""
        cfg = self.cfg
        B, T, _ = x.shape
        project = lambda name, heads: _dense(heads * cfg.head_dim, cfg, name, cfg.qkv_bias)(x).reshape(
            B, T, heads, cfg.head_dim)
        q, k, v = project("q", cfg.num_heads), project("k", cfg.num_kv_heads), project("v", cfg.num_kv_heads)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="k_norm")(k)
        inv_freq = cfg.rope.inv_freq(cfg.head_dim)
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        k_all = write_tokens(k_all, layer, k, start)
        v_all = write_tokens(v_all, layer, v, start)
        o = ragged_attention(q, k_all[layer], v_all[layer], kv_len, causal=True, sliding_window=cfg.sliding_window,
                             impl=cfg.attention_impl)
        return _dense(cfg.hidden_size, cfg, "o")(o.reshape(B, T, -1)), k_all, v_all


class DecoderLayer(nn.Module):
    cfg: TargetConfig
    hooks: tuple[int, ...]  # normalised hook indices; layer i's output is hidden state i + 1

    @nn.compact
    def __call__(self, carry, xs, positions, start, kv_len):
        cfg = self.cfg
        h, k_all, v_all, hooked = carry
        layer = xs
        attn_out, k_all, v_all = Attention(cfg, name="attn")(
            RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="input_norm")(h), positions, k_all, v_all, layer, start, kv_len
        )
        h = h + attn_out
        h = h + SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, name="mlp")(
            RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="post_norm")(h)
        )
        hooked = tuple(jnp.where(layer + 1 == idx, h, prev) for idx, prev in zip(self.hooks, hooked))
        return (h, k_all, v_all, hooked), None


class Target(nn.Module):
    """Returns (logits, cache, hidden) where hidden maps each requested hook index to [B, T, d]."""

    cfg: TargetConfig
    hooks: tuple[int, ...] = ()  # hidden states to return (HF indexing: 0 = embeddings, L = final-normed output)

    def setup(self):
        cfg = self.cfg
        self._hooks = tuple(cfg.hook_index(i) for i in self.hooks)
        self._inner = tuple(i for i in self._hooks if 0 < i < cfg.num_layers)
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.dtype)
        self.layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
        )(cfg, self._inner)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _dense(cfg.vocab_size, cfg, None)

    def __call__(
        self,
        tokens: jax.Array,  # int32[B, T]
        cache: KVCache,
        num_new: jax.Array | None = None,  # int32[B]: real tokens per row (the rest is right padding); default T
        logits_at: jax.Array | None = None,  # int32[B, P]: positions in [0, T) to compute logits for; default all
    ):
        cfg = self.cfg
        B, T = tokens.shape
        h = self.embed(tokens)
        start = cache.lengths
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        kv_len = start + T  # every written slot; padded queries only ever see padded keys (causal)
        with jax.named_scope("layers"):
            (h_last, k_all, v_all, hooked), _ = self.layers(
                (h, cache.k, cache.v, tuple(jnp.zeros_like(h) for _ in self._inner)),
                jnp.arange(cfg.num_layers),
                positions,
                start,
                kv_len,
            )
        h_final = self.final_norm(h_last)
        states = {0: h, cfg.num_layers: h_final, **dict(zip(self._inner, hooked))}
        hidden = {i: states[i] for i in self._hooks}
        x = h_final if logits_at is None else jnp.take_along_axis(h_final, logits_at[:, :, None], axis=1)
        added = jnp.full((B,), T, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
        return self.logits(x), KVCache(k_all, v_all, cache.lengths + added), hidden

    def logits(self, x):
        """LM head on final-normed states, float32 (tied embeddings or a separate head)."""
        with jax.named_scope("lm_head"):
            out = self.embed.attend(x) if self.cfg.tie_embeddings else self.lm_head(x)
        return out.astype(jnp.float32)

    def head(self, x):
        """Final norm + LM head: what the drafter applies to its slot outputs."""
        return self.logits(self.final_norm(x))
