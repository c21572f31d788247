"""The SpecFormer drafter: a small head that drafts K future tokens per position in one parallel pass.

hooked target states -> RMSNorm each -> concat -> Dense(n*d -> d, no bias)
  (context_token_input: the embedding of the next token, RMSNormed, joins the concat: Dense((n+1)*d -> d))
  -> + causal attention over the context (RoPE at true positions, own KV cache: a "layer L+1")
  -> RMSNorm -> Dense(d -> K*d, bias) -> K slots (no residual)
  -> + attention among the K slots (bidirectional, no RoPE; or causal with RoPE over slot index)
  -> keep the first k <= K slots -> + SwiGLU -> the target's final norm and LM head (frozen, shared).
Slot i at position t predicts token t + 2 + i: the target itself already predicts t + 1 from position t.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct

from pallas_kernels import ragged_attention_reference
from pallas_kernels.cpu import panel_columns
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.kv_cache import KVCache, target_cache
from specformer_jax.modeling.layers import (
    RMSNorm,
    SwiGLU,
    array_module,
    dense,
    logical_axes,
    packed_columns,
    rope,
    rope_table,
)
from specformer_jax.modeling.target import Attention, Target


@struct.dataclass
class DrafterParams:
    """A drafter's parameters: the weights of the `Drafter` module and, for a drafter with a reduced draft vocabulary
    (DrafterConfig.draft_vocab_size), the token ids it drafts over. A pytree: what training, the files and the
    engine pass along."""

    weights: dict  # the Drafter module's "params"
    vocab: jax.Array | None = None  # int32[V']: the draft vocabulary's token ids, ascending; None: the whole vocabulary


def drafter_cache(target: TargetConfig, batch: int, max_len: int) -> KVCache:
    """The drafter's own one-layer KV cache; its lengths move in lockstep with the target's."""
    return target_cache(target, batch, max_len, num_layers=1)


class SlotAttention(nn.Module):
    """Self-attention among the K slots of every position: x [..., K, d] -> [..., K, d]. A plain einsum: K is 4..8."""

    target: TargetConfig
    causal: bool
    packed: bool = False  # projections as column panels (`pack_drafter`)

    @nn.compact
    def __call__(self, x):
        t = self.target
        *lead, K, d = x.shape
        x = x.reshape(-1, K, d)
        N = x.shape[0]
        proj = lambda n, axes, name: dense(n, t.dtype, axes, name=name, packed=self.packed)
        q = proj(t.num_heads * t.head_dim, ("embed", "heads"), "q")(x).reshape(N, K, t.num_heads, t.head_dim)
        k = proj(t.num_kv_heads * t.head_dim, ("embed", "kv_heads"), "k")(x).reshape(N, K, t.num_kv_heads, t.head_dim)
        v = proj(t.num_kv_heads * t.head_dim, ("embed", "kv_heads"), "v")(x).reshape(N, K, t.num_kv_heads, t.head_dim)
        if self.causal:  # the released code's variant: RoPE over slot positions 0..K-1
            pos = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (N, K))
            rotation = rope_table(pos, t.rope.inv_freq(t.head_dim), K)
            q, k = rope(q, rotation), rope(k, rotation)
        full = jnp.full((N,), K, jnp.int32)
        o = ragged_attention_reference(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), full, causal=self.causal)
        return proj(d, ("heads", "embed"), "o")(o.reshape(N, K, -1)).reshape(*lead, K, d)


class Drafter(nn.Module):
    target: TargetConfig
    cfg: DrafterConfig
    packed: bool = False  # weights as column panels for the CPU kernels (`pack_drafter`): decoding on a CPU

    def setup(self):
        t, c, packed = self.target, self.cfg, self.packed
        norm = lambda: RMSNorm(t.rms_norm_eps, t.dtype)
        self.hooks = c.resolved_hooks(t)
        self.hook_norms = [norm() for _ in self.hooks]
        if c.context_token_input:
            self.context_next_norm = norm()
        self.fuse = dense(t.hidden_size, t.dtype, (None, "embed"), packed=packed)
        self.context_norm = norm()
        # Same head layout as the target, but no qkv bias, no q/k norm, no sliding window (as in the paper's code),
        # and separate q/k/v whatever the target's parameter layout: the drafter's parameters keep one layout.
        self.context_attn = Attention(dataclasses.replace(t, qkv_bias=False, qk_norm=False, sliding_window=None,
                                                          fuse_projections=False, pack_weights=packed))
        self.expand_norm = norm()
        # the bias acts as a learned per-slot embedding
        self.expand = dense(c.num_slots * t.hidden_size, t.dtype, ("embed", None), bias=True, packed=packed)
        self.slot_norm = norm()
        self.slot_attn = SlotAttention(t, causal=c.slot_attention == "causal", packed=packed)
        self.ffn_norm = norm()
        self.ffn = SwiGLU(t.hidden_size, c.intermediate_size or t.intermediate_size, t.dtype, packed=packed)
        if c.next_token_input:  # zero-initialised: starts as the paper's drafter (and continues one exactly)
            self.next_norm = norm()
            self.next_proj = dense(t.hidden_size, t.dtype, (None, "embed"), kernel_init=nn.initializers.zeros,
                                   packed=packed)

    def __call__(
        self,
        hidden: Mapping[int, jax.Array],  # hook index -> [B, T, d] target states for the T new tokens
        cache: KVCache,  # the drafter's one-layer cache
        num_new: jax.Array | None = None,  # int32[B]: real new tokens per row; default T
        slots_at: jax.Array | None = None,  # int32[B, P]: positions to draft from; default all T
        draft_len: int | None = None,  # k <= K slots to keep (decoding may draft fewer than were trained)
        next_embed: jax.Array | None = None,  # [B, T, d]: target embedding of the token after each new position
    ):
        """Returns (slot states [B, P, k, d] before the target's final norm + LM head, updated cache)."""
        if self.cfg.reads_next_tokens and next_embed is None:
            raise ValueError("this drafter needs the embedding of the token after each position")
        h, cache = self.context(hidden, cache, num_new, next_embed)
        if slots_at is not None:
            h = jnp.take_along_axis(h, slots_at[:, :, None], axis=1)
            if next_embed is not None:
                next_embed = jnp.take_along_axis(next_embed, slots_at[:, :, None], axis=1)
        return self.slots(h, draft_len, next_embed), cache

    def context(self, hidden, cache: KVCache, num_new=None, next_embed=None):
        """Fuse the hooked states (and with context_token_input the next tokens' embeddings [B, T, d]) and run the
        causal context layer: [B, T, d], appending to the cache."""
        missing = [i for i in self.hooks if i not in hidden]
        if missing:
            raise ValueError(f"drafter needs target hidden states {missing}")
        parts = [n(hidden[i]) for i, n in zip(self.hooks, self.hook_norms)]
        if self.cfg.context_token_input:
            parts.append(self.context_next_norm(next_embed.astype(parts[0].dtype)))
        x = jnp.concatenate(parts, axis=-1)
        x = self.fuse(x)
        B, T, _ = x.shape
        start = cache.lengths
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        rotation = rope_table(positions, self.target.rope.inv_freq(self.target.head_dim), cache.max_len)
        a, k, v = self.context_attn(self.context_norm(x), rotation, cache.k, cache.v, 0, start, start + T)
        added = jnp.full((B,), T, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
        return x + a, KVCache(k, v, cache.lengths + added)

    def slots(self, h, draft_len=None, next_embed=None):
        """Expand each position into K slots and run the slot encoder layer: [..., d] -> [..., k, d]."""
        t, K = self.target, self.cfg.num_slots
        if self.cfg.next_token_input:
            h = h + self.next_proj(self.next_norm(next_embed.astype(h.dtype)))
        m = self.expand(self.expand_norm(h)).reshape(*h.shape[:-1], K, t.hidden_size)
        m = m + self.slot_attn(self.slot_norm(m))  # all K slots attend, so truncating afterwards stays consistent
        m = m[..., : draft_len or K, :]
        return m + self.ffn(self.ffn_norm(m))


def apply_drafter(target_cfg: TargetConfig, cfg: DrafterConfig, params: DrafterParams, *args, packed: bool = False,
                  **kwargs):
    """`Drafter(target_cfg, cfg, packed)` applied with the weights of `params` (the call's arguments as Drafter's;
    `packed`: weights from `pack_drafter`)."""
    return Drafter(target_cfg, cfg, packed).apply({"params": params.weights}, *args, **kwargs)


def pack_drafter(weights: dict) -> dict:
    """A drafter's weights in the layout of `Drafter(..., packed=True)`: every dense kernel as column panels for the
    CPU kernels (layers.packed_columns: on the host), the SwiGLU's gate and up in one ("gate_up", as the target's
    packed layers). A copy: made when a source is bound to a target (decoding/draft_source.py, `bind`).

    Panels whose values bfloat16 holds exactly (a drafter's file stores them in bfloat16) are kept in bfloat16: the
    kernel reads half the bytes and sums the same float32 values, so the drafts are bitwise those of float32 panels.
    Under a trace the values are unknown, and the panels stay in the weights' dtype."""
    def one(p):
        if "kernel" not in p:
            return {n: one(q) for n, q in p.items()} if all(isinstance(q, dict) for q in p.values()) else p
        return {"panels": _narrowed(packed_columns(p["kernel"])), **({"bias": p["bias"]} if "bias" in p else {})}

    ffn = dict(weights["ffn"])
    gate, up = ffn.pop("gate")["kernel"], ffn.pop("up")["kernel"]
    xp = array_module(gate)
    ffn["gate_up"] = {"kernel": xp.concatenate([xp.asarray(gate), xp.asarray(up)], axis=1)}
    return one({**weights, "ffn": ffn})


def _narrowed(w: jax.Array) -> jax.Array:
    """w in bfloat16 where that loses nothing (checked on the host), else w; w itself under a trace."""
    if w.dtype != jnp.float32 or array_module(w) is jnp:
        return w
    wide = np.asarray(w)
    narrow = wide.astype(jnp.bfloat16)
    return jnp.asarray(narrow) if np.array_equal(narrow.astype(np.float32), wide) else w


def next_token_embedding(target_params, next_tokens: jax.Array) -> jax.Array:
    """The target's (frozen) input embedding of the token after each drafting position: int32[...] -> [..., d]
    (from the packed layout's panels too: `PackedEmbed`)."""
    embed = target_params["embed"]
    if "panels" in embed:
        return panel_columns(embed["panels"], next_tokens)
    return jnp.take(embed["embedding"], next_tokens, axis=0)


def vocab_head(target_cfg: TargetConfig, target_params, vocab: jax.Array | None):
    """(config, parameters) of the target's final norm + LM head restricted to the token ids `vocab` (int32[V']):
    `Target.head` with them gives logits over V' only. vocab None: the whole head, unchanged."""
    if vocab is None:
        return target_cfg, target_params
    cfg = dataclasses.replace(target_cfg, vocab_size=vocab.shape[0], tie_embeddings=False)
    if target_cfg.pack_weights:  # the vocabulary's columns of the head's panels, packed again
        panels = target_params["embed" if target_cfg.tie_embeddings else "lm_head"]["panels"]
        xp = array_module(panels)
        columns = panel_columns(xp.asarray(panels), xp.asarray(vocab))
        head = {"panels": packed_columns(columns.T)}
        return cfg, {"final_norm": target_params["final_norm"], "lm_head": head}
    matrix = (target_params["embed"]["embedding"][vocab].T if target_cfg.tie_embeddings
              else target_params["lm_head"]["kernel"][:, vocab])
    return cfg, {"final_norm": target_params["final_norm"], "lm_head": {"kernel": matrix}}


def _draft_head_dtype(target_cfg: TargetConfig) -> str:
    """bfloat16 on accelerators; the model's own dtype on CPUs, where XLA's bfloat16 matmuls run several times slower
    than float32 ones (about 5x: "Why a round cost more than a step" in `git show 3102113:benchmarks/README.md`)."""
    return target_cfg.dtype if jax.default_backend() == "cpu" else "bfloat16"


@struct.dataclass
class DraftHead:
    """The target's final norm and LM head as drafting uses them (`draft_head`)."""

    params: dict  # final_norm; the head matrix (lm_head, or the tied embed) over the draft vocabulary; embed
    vocab: jax.Array | None  # int32[V']: the token of each logit; None: logit i is token i


def draft_head(target_cfg: TargetConfig, target_params, vocab: jax.Array | None = None) -> DraftHead:
    """The target's final norm and LM head for drafting, restricted to the draft vocabulary `vocab` (a drafter's
    DrafterParams.vocab) when there is one, the head matrix in `_draft_head_dtype`; the input embedding too (the
    tokens a drafter reads).

    Drafting reads the head's matrix (V or V' rows) once more per round; in bfloat16 that read costs half. Drafts only
    need the logits' ranking (and, when sampling, verification uses the distribution they were actually drawn
    from), so the output stays exactly the target's.
    """
    dtype = _draft_head_dtype(target_cfg)
    _, reduced = vocab_head(target_cfg, target_params, vocab)
    head = {"final_norm": target_params["final_norm"]}
    for name in ("embed", "lm_head"):
        if name in reduced or name in target_params:
            head[name] = jax.tree.map(lambda w: w.astype(dtype), reduced.get(name, target_params.get(name)))
    return DraftHead(head, vocab)


def draft_logits(target_cfg: TargetConfig, head: DraftHead, slot_states: jax.Array) -> jax.Array:
    """Final norm + LM head (`draft_head`) on drafter slot states: float32 logits over the draft vocabulary (position
    i: token head.vocab[i] when there is one, else token i)."""
    cfg = dataclasses.replace(target_cfg, dtype=_draft_head_dtype(target_cfg))
    if head.vocab is not None:
        cfg = dataclasses.replace(cfg, vocab_size=head.vocab.shape[0], tie_embeddings=False)
    return Target(cfg).apply({"params": head.params}, slot_states.astype(cfg.dtype), method=Target.head)


def _init(target_cfg: TargetConfig, cfg: DrafterConfig, key: jax.Array) -> dict:
    """`Drafter.init`'s weights from `key`, each boxed with its logical axes."""
    hidden = {i: jnp.zeros((1, 2, target_cfg.hidden_size), target_cfg.dtype) for i in cfg.resolved_hooks(target_cfg)}
    next_embed = jnp.zeros((1, 2, target_cfg.hidden_size), target_cfg.dtype)
    return Drafter(target_cfg, cfg).init(key, hidden, drafter_cache(target_cfg, 1, 2), next_embed=next_embed)["params"]


@functools.lru_cache(maxsize=16)
def _boxed_weights(target_cfg: TargetConfig, cfg: DrafterConfig):
    """The weights `Drafter.init` makes, as shapes boxed with their axes (traced once per pair of configs)."""
    return jax.eval_shape(lambda: _init(target_cfg, cfg, jax.random.key(0)))


def drafter_shapes(target_cfg: TargetConfig, cfg: DrafterConfig) -> DrafterParams:
    """ShapeDtypeStructs of the parameters of a drafter with `cfg` on a target with `target_cfg`."""
    vocab = None if cfg.draft_vocab_size is None else jax.ShapeDtypeStruct((cfg.draft_vocab_size,), jnp.int32)
    return DrafterParams(nn.unbox(_boxed_weights(target_cfg, cfg)), vocab)


def drafter_axes(target_cfg: TargetConfig, cfg: DrafterConfig) -> DrafterParams:
    """The logical axes of a drafter's parameters (PartitionSpecs of axis names); the draft vocabulary is never
    split."""
    vocab = None if cfg.draft_vocab_size is None else jax.sharding.PartitionSpec(None)
    return DrafterParams(logical_axes(_boxed_weights(target_cfg, cfg)), vocab)


def init_drafter(target_cfg: TargetConfig, cfg: DrafterConfig, rng: jax.Array,
                 vocab: jax.Array | None = None) -> DrafterParams:
    """Fresh drafter parameters (shapes only depend on the configs), with the draft vocabulary `vocab` (int32[V'],
    for a cfg with draft_vocab_size)."""
    weights = jax.jit(lambda key: nn.unbox(_init(target_cfg, cfg, key)))(rng)  # op by op, init runs several x slower
    return DrafterParams(weights, None if vocab is None else jnp.asarray(vocab, jnp.int32))
