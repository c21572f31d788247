"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) as a functional Flax module.

One call serves prefill and multi-token extension: the T new tokens of row b are written to the KV cache at
positions cache.lengths[b] .. cache.lengths[b] + T - 1 and attend causally to everything before them.
Parameter layouts (TargetConfig.unroll_layers, .fuse_projections, .pack_weights): checkpoints and training stack
the layers' parameters under "layers" and run them under `nn.scan` (one compiled layer body: compile time flat in
depth); decoding runs a Python loop over per-layer parameters "layers_0" .. "layers_{L-1}", optionally with q/k/v and
gate/up fused, and on CPUs packed for the CPU kernels (`decoding_params` converts). Inside a compiled scan XLA copies
each layer's weights out of the stacked arrays before its matmuls; separate per-layer arrays are read in place, which
matters where a step reads every weight once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from pallas_kernels import ragged_attention
from pallas_kernels.cpu import unpack_columns
from specformer_jax.config import TargetConfig
from specformer_jax.modeling.kv_cache import KVCache, target_cache, write_tokens
from specformer_jax.modeling.layers import (
    PackedEmbed,
    RMSNorm,
    SwiGLU,
    dense,
    logical_axes,
    packed_columns,
    rope,
    rope_table,
    with_axes,
)


def _project_qkv(cfg: TargetConfig, x):
    """q [B, T, H, D] and k, v [B, T, Hkv, D]: three matmuls, or one with cfg.fuse_projections. The fused kernel
    "qkv" [d, Hkv, G + 2, D] groups each KV head's G query heads with its key and value, so that tensor parallelism
    can shard it by KV head like the separate kernels. With cfg.pack_weights the kernels are column panels
    (`PackedDense`), the fused one's columns in the same order."""
    B, T, _ = x.shape
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // Hkv
    if cfg.pack_weights and cfg.fuse_projections:  # the fused kernel as column panels, its columns in their order
        qkv = dense(Hkv * (G + 2) * D, cfg.dtype, ("embed", "kv_heads"), bias=cfg.qkv_bias, name="qkv",
                    packed=True)(x).reshape(B, T, Hkv, G + 2, D)
        return qkv[..., :G, :].reshape(B, T, H, D), qkv[..., G, :], qkv[..., G + 1, :]
    if cfg.fuse_projections:
        qkv = nn.DenseGeneral((Hkv, G + 2, D), use_bias=cfg.qkv_bias, dtype=cfg.dtype, param_dtype=cfg.dtype,
                              kernel_init=with_axes(nn.linear.default_kernel_init, "embed", "kv_heads", None, None),
                              bias_init=with_axes(nn.initializers.zeros_init(), "kv_heads", None, None),
                              name="qkv")(x)
        return qkv[..., :G, :].reshape(B, T, H, D), qkv[..., G, :], qkv[..., G + 1, :]
    project = lambda name, heads, axis: dense(heads * D, cfg.dtype, ("embed", axis), bias=cfg.qkv_bias, name=name,
                                              packed=cfg.pack_weights)(x).reshape(B, T, heads, D)
    return project("q", H, "heads"), project("k", Hkv, "kv_heads"), project("v", Hkv, "kv_heads")


class Attention(nn.Module):
    """GQA self-attention that appends its keys/values to one layer of the cache before attending."""

    cfg: TargetConfig

    @nn.compact
    def __call__(self, x, rotation, k_all, v_all, layer, start, kv_len, rows=None):
        """Appends this layer's keys/values to the stacked caches [L, B', Hkv, S, D] at `layer` (row b in cache row
        rows[b], default b); returns them too. rotation: `rope_table` at the tokens' positions."""
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = _project_qkv(cfg, x)
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="k_norm")(k)
        q, k = rope(q, rotation), rope(k, rotation)
        k_all = write_tokens(k_all, layer, k, start, rows)
        v_all = write_tokens(v_all, layer, v, start, rows)
        o = ragged_attention(q, k_all, v_all, kv_len, causal=True, sliding_window=cfg.sliding_window,
                             impl=cfg.attention, layer=layer, rows=rows)
        out = dense(cfg.hidden_size, cfg.dtype, ("heads", "embed"), name="o", packed=cfg.pack_weights)
        return out(o.reshape(B, T, -1)), k_all, v_all


class DecoderLayer(nn.Module):
    """One layer as a scan body: carry (h, k_all, v_all, hooked), xs the layer index (an int when unrolled)."""

    cfg: TargetConfig
    hooks: tuple[int, ...]  # normalised hook indices picked up into `hooked`; layer i's output is hidden state i + 1

    @nn.compact
    def __call__(self, carry, xs, rotation, start, kv_len, rows=None):
        cfg = self.cfg
        h, k_all, v_all, hooked = carry
        layer = xs
        attn_out, k_all, v_all = Attention(cfg, name="attn")(
            RMSNorm(cfg.rms_norm_eps, cfg.dtype, name="input_norm")(h), rotation, k_all, v_all, layer, start, kv_len,
            rows)
        h = h + attn_out
        h = h + SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, cfg.fuse_projections, cfg.pack_weights,
                       name="mlp")(
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
        if cfg.pack_weights:
            self.embed = PackedEmbed(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        else:
            self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype, param_dtype=cfg.dtype,
                                  embedding_init=with_axes(nn.linear.default_embed_init, "vocab", "embed"))
        if cfg.unroll_layers:
            self.layers = [DecoderLayer(cfg, ()) for _ in range(cfg.num_layers)]  # params "layers_0", "layers_1", ...
        else:
            self.layers = nn.scan(
                DecoderLayer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: None},  # the stacked layers' axis is never split
            )(cfg, self._inner)
        self.final_norm = RMSNorm(cfg.rms_norm_eps, cfg.dtype)
        if not cfg.tie_embeddings:
            self.lm_head = dense(cfg.vocab_size, cfg.dtype, ("embed", "vocab"), packed=cfg.pack_weights)

    def __call__(
        self,
        tokens: jax.Array,  # int32[B, T]
        cache: KVCache,
        num_new: jax.Array | None = None,  # int32[B]: real tokens per row (the rest is right padding); default T
        logits_at: jax.Array | None = None,  # int32[B, P]: positions in [0, T) to compute logits for; default all
    ):
        h_final, cache, hidden = self.forward(tokens, cache, num_new)
        x = h_final if logits_at is None else jnp.take_along_axis(h_final, logits_at[:, :, None], axis=1)
        return self.logits(x), cache, hidden

    def forward(self, tokens: jax.Array, cache: KVCache, num_new: jax.Array | None = None):
        """(final-normed states [B, T, d], cache, hidden): `__call__` without the LM head."""
        B, T = tokens.shape
        h = self.embed(tokens)
        start = cache.lengths
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        kv_len = start + T  # every written slot; padded queries only ever see padded keys (causal)
        h_final, k_all, v_all, hidden = self._layers(h, cache, positions, start, kv_len, None)
        added = jnp.full((B,), T, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
        return h_final, KVCache(k_all, v_all, cache.lengths + added), hidden

    def forward_flat(self, tokens: jax.Array, rows: jax.Array, positions: jax.Array, cache: KVCache):
        """The flat layout of a verify pass: token t (int32[T]) of cache row rows[t] at position positions[t], each
        seeing its row's cache below that position, itself included (a request's positions in a round are written
        before any is attended to, so each sees those before it). A position at or past the cache's end is padding:
        its keys are dropped and it attends to nothing. Returns (final-normed states [T, d], the cache with the
        positions written and its lengths unchanged, {hook: [T, d]}): a position costs its row of every matmul and
        its row's cache, whatever the other rows verify."""
        kv_len = jnp.where(positions < cache.max_len, positions + 1, 0)
        h_final, k_all, v_all, hidden = self._layers(self.embed(tokens[:, None]), cache, positions[:, None],
                                                     positions, kv_len, rows)
        return h_final[:, 0], cache.replace(k=k_all, v=v_all), {i: x[:, 0] for i, x in hidden.items()}

    def _layers(self, h, cache: KVCache, positions, start, kv_len, rows):
        """The embedded tokens h through every layer and the final norm: (final-normed states, the caches' keys and
        values with the new ones written, {hook: state}); `forward` and `forward_flat` differ only in what they
        give it."""
        run = self._unrolled if self.cfg.unroll_layers else self._scanned
        rotation = rope_table(positions, self.cfg.rope.inv_freq(self.cfg.head_dim), cache.max_len)
        with jax.named_scope("layers"):
            h_last, k_all, v_all, hooked = run(h, cache.k, cache.v, rotation, start, kv_len, rows)
        h_final = self.final_norm(h_last)
        states = {0: h, self.cfg.num_layers: h_final, **hooked}
        return h_final, k_all, v_all, {i: states[i] for i in self._hooks}

    def _scanned(self, h, k_all, v_all, *args):
        """All layers under one scan; the inner hooks' states are picked up as they pass. Returns (h, k_all, v_all,
        {hook index: state})."""
        hooked = tuple(jnp.zeros_like(h) for _ in self._inner)
        (h, k_all, v_all, hooked), _ = self.layers((h, k_all, v_all, hooked), jnp.arange(self.cfg.num_layers), *args)
        return h, k_all, v_all, dict(zip(self._inner, hooked))

    def _unrolled(self, h, k_all, v_all, *args):
        """The layers one after another, each with its own parameters; same returns as `_scanned`."""
        hooked = {}
        for i, layer in enumerate(self.layers):
            (h, k_all, v_all, _), _ = layer((h, k_all, v_all, ()), i, *args)
            if i + 1 in self._inner:
                hooked[i + 1] = h
        return h, k_all, v_all, hooked

    def logits(self, x):
        """LM head on final-normed states, float32 (tied embeddings or a separate head)."""
        with jax.named_scope("lm_head"):
            if self.cfg.tie_embeddings:  # the embedding's rows are the head's
                out = self.embed.attend(x)
            else:
                out = self.lm_head(x)
        return out.astype(jnp.float32)

    def head(self, x):
        """Final norm + LM head: what the drafter applies to its slot outputs."""
        return self.logits(self.final_norm(x))


@functools.lru_cache(maxsize=16)
def _boxed_params(cfg: TargetConfig):
    """The parameters `Target(cfg).init` makes, as shapes, each boxed with its logical axes (traced once per cfg: the
    shapes and the axes below both come from it)."""
    cache = KVCache.zeros(cfg.num_layers, 1, 1, cfg.num_kv_heads, cfg.head_dim)
    return jax.eval_shape(Target(cfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32), cache)["params"]


def target_shapes(cfg: TargetConfig) -> dict:
    """ShapeDtypeStructs of the parameters of a target with `cfg`, in cfg's layout."""
    return nn.unbox(_boxed_params(cfg))


def target_axes(cfg: TargetConfig) -> dict:
    """The logical axes of the parameters of a target with `cfg` (PartitionSpecs of axis names), in cfg's layout."""
    return logical_axes(_boxed_params(cfg))


def init_target(cfg: TargetConfig, rng: jax.Array) -> dict:
    """Fresh target parameters drawn by the model's own initialisers, compiled (op by op, init is slow)."""
    cache = target_cache(cfg, 1, 2)
    return jax.jit(lambda key: nn.unbox(Target(cfg).init(key, jnp.zeros((1, 2), jnp.int32), cache)["params"]))(rng)


def decoding_params(cfg: TargetConfig, params, fuse: bool = False, pack: bool = False) -> tuple[TargetConfig, dict]:
    """(config, parameters) in a decoding layout: per-layer parameters "layers_{i}" (cfg.unroll_layers); with `fuse`,
    q/k/v fused into "qkv" and gate/up into "gate_up" (cfg.fuse_projections); with `pack` (fused too), every layer
    kernel, the LM head and the embedding (its transpose: `PackedEmbed`) held as column panels for the CPU matmul
    kernels (cfg.pack_weights, pallas_kernels/cpu.py). From the stacked layout of checkpoints and training, or from
    another decoding layout.

    On an accelerator, fusing pays where a step's matmuls are matrix-vector products (one row of one token); XLA runs
    wider steps' independent matmuls side by side. On a CPU the packed layout serves every batch size: its kernels
    read each weight once per call for any number of rows. The final norm is kept as it is; the other weights are
    copied, so convert once per model (LoadedTarget.use_decoding_layout
    holds the result in place of the old copy), on the loaded arrays (not inside a compiled step, which would copy
    the slices at every call). A config already in the requested layout comes back unchanged."""
    fuse = fuse or pack
    if cfg.unroll_layers and cfg.fuse_projections == fuse and cfg.pack_weights == pack:
        return cfg, params
    out = {name: p for name, p in params.items() if not name.startswith("layers")}
    if cfg.pack_weights != pack:
        out.update(_head_packed(cfg, out) if pack else _head_unpacked(cfg, out))
    fused = cfg.unroll_layers and cfg.fuse_projections
    for i in range(cfg.num_layers):  # op by op: every layer has the same shapes, so each op compiles once
        layer = params[f"layers_{i}"] if cfg.unroll_layers else jax.tree.map(lambda w: w[i], params["layers"])
        layer = _unpacked(cfg, layer) if cfg.pack_weights else layer
        layer = _unfused(cfg, layer) if fused and not fuse else _fused(cfg, layer) if fuse and not fused else layer
        out[f"layers_{i}"] = _packed(layer) if pack else layer
    return dataclasses.replace(cfg, unroll_layers=True, fuse_projections=fuse, pack_weights=pack), out


def _head_packed(cfg: TargetConfig, params) -> dict:
    """The embedding [V, d] as the panels of its transpose (`PackedEmbed`), an untied head's kernel [d, V] as
    panels (`PackedDense`)."""
    out = {"embed": {"panels": packed_columns(params["embed"]["embedding"].T)}}
    if not cfg.tie_embeddings:
        out["lm_head"] = {"panels": packed_columns(params["lm_head"]["kernel"])}
    return out


def _head_unpacked(cfg: TargetConfig, params) -> dict:
    """`_head_packed` undone."""
    out = {"embed": {"embedding": unpack_columns(params["embed"]["panels"], cfg.vocab_size).T}}
    if not cfg.tie_embeddings:
        out["lm_head"] = {"kernel": unpack_columns(params["lm_head"]["panels"], cfg.vocab_size)}
    return out


def _packed(layer) -> dict:
    """A fused layer with every kernel as column panels "panels" (`pack_columns` of the kernel as an [in, out]
    matrix) and the q/k/v bias flat: the parameters `PackedDense` reads."""
    def one(p):
        if "kernel" not in p:  # norms
            return p
        return {"panels": packed_columns(p["kernel"].reshape(p["kernel"].shape[0], -1)),
                **({"bias": p["bias"].reshape(-1)} if "bias" in p else {})}

    return {**layer, "attn": {n: one(p) for n, p in layer["attn"].items()},
            "mlp": {n: one(p) for n, p in layer["mlp"].items()}}


def _unpacked(cfg: TargetConfig, layer) -> dict:
    """`_packed` undone: the fused layer's kernels and bias in their shapes again."""
    fused = target_shapes(dataclasses.replace(cfg, pack_weights=False))["layers_0"]

    def one(p, shapes):
        if "panels" not in p:
            return p
        kernel = shapes["kernel"].shape
        return {"kernel": unpack_columns(p["panels"], int(np.prod(kernel[1:]))).reshape(kernel),
                **({"bias": p["bias"].reshape(shapes["bias"].shape)} if "bias" in p else {})}

    return {**layer, **{part: {n: one(p, fused[part][n]) for n, p in layer[part].items()} for part in ("attn", "mlp")}}


def _fused(cfg: TargetConfig, layer) -> dict:
    """One layer's parameters with q/k/v as "qkv" [d, Hkv, G + 2, D] (see `_project_qkv`) and gate/up as "gate_up"
    [d, 2, intermediate]; biases follow their kernels."""
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    q, k, v = attn.pop("q"), attn.pop("k"), attn.pop("v")
    Hkv, D = cfg.num_kv_heads, cfg.head_dim
    by_kv_head = lambda w: w.reshape(*w.shape[:-1], Hkv, -1, D)  # [..., n * D] -> [..., Hkv, n / Hkv, D]
    attn["qkv"] = {name: jnp.concatenate([by_kv_head(p[name]) for p in (q, k, v)], axis=-2) for name in q}
    mlp["gate_up"] = {"kernel": jnp.stack([mlp.pop("gate")["kernel"], mlp.pop("up")["kernel"]], axis=-2)}
    return {**layer, "attn": attn, "mlp": mlp}


def _unfused(cfg: TargetConfig, layer) -> dict:
    """`_fused` undone: separate q/k/v and gate/up again."""
    attn, mlp = dict(layer["attn"]), dict(layer["mlp"])
    qkv, gate_up = attn.pop("qkv"), mlp.pop("gate_up")["kernel"]
    G = cfg.num_heads // cfg.num_kv_heads
    flat = lambda w: w.reshape(*w.shape[:-3], -1)  # [..., Hkv, n, D] -> [..., Hkv * n * D]
    parts = {"q": slice(0, G), "k": slice(G, G + 1), "v": slice(G + 1, G + 2)}
    attn.update({p: {name: flat(w[..., at, :]) for name, w in qkv.items()} for p, at in parts.items()})
    mlp.update(gate={"kernel": gate_up[..., 0, :]}, up={"kernel": gate_up[..., 1, :]})
    return {**layer, "attn": attn, "mlp": mlp}
