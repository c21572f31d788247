"""The target's decoding layouts (per-layer parameters, with or without fused projections, or packed for the CPU
kernels; `decoding_params`) compute what the stacked layout of checkpoints and training computes: logits, KV cache
and hidden states, for prefill and cached extension."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from pallas_kernels.cpu import build_cpu_kernels, unpack_columns
from specformer_jax.config import TargetConfig
from specformer_jax.files import cache_dir
from specformer_jax.modeling.kv_cache import target_cache
from specformer_jax.modeling.target import Target, decoding_params, target_axes, target_shapes
from specformer_jax.parallel import AXES, param_shardings

BASE = TargetConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2)
CONFIGS = {
    "llama": BASE,
    "qwen2": dataclasses.replace(BASE, qkv_bias=True, tie_embeddings=True, model_type="qwen2"),
    "qwen3": dataclasses.replace(BASE, qk_norm=True, head_dim=32, tie_embeddings=True, model_type="qwen3"),
    "mistral": dataclasses.replace(BASE, num_kv_heads=1, sliding_window=4, model_type="mistral"),
}
HOOKS = (0, 1, 2, -1)  # the embeddings, both inner layers' outputs, the final-normed output
LAYOUTS = [(False, False), (True, False), (False, True)]  # (fuse, pack): per layer, fused, packed (fused too)


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """The packed layout runs on the CPU kernels, as in decoding (without them its products run in XLA)."""
    assert build_cpu_kernels(cache_dir() / "kernels") is None


def random_params(cfg: TargetConfig):
    """Stacked-layout parameters, every tensor random (norm scales and biases too, so a misplaced one would show);
    drawn with numpy, as compiling Flax's init takes seconds."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), target_shapes(cfg))


def assert_same_outputs(a, b):
    (logits_a, cache_a, hidden_a), (logits_b, cache_b, hidden_b) = a, b
    np.testing.assert_allclose(logits_a, logits_b, atol=1e-4, rtol=1e-4)
    for x, y in ((cache_a.k, cache_b.k), (cache_a.v, cache_b.v)):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(cache_a.lengths, cache_b.lengths)
    assert hidden_a.keys() == hidden_b.keys()
    for i in hidden_a:
        np.testing.assert_allclose(hidden_a[i], hidden_b[i], atol=1e-4, rtol=1e-4, err_msg=f"hidden state {i}")


@functools.partial(jax.jit, static_argnums=0)
def prefill_extend_step(cfg: TargetConfig, params, prompts, extension, step):
    """A ragged prefill (right padding), a ragged 3-token extension with logits at chosen positions, and a one-token
    step: each call's (logits, cache, hidden). One program, so each layout compiles once."""
    model = Target(cfg, HOOKS)
    B = prompts.shape[0]
    prefilled = model.apply({"params": params}, prompts, target_cache(cfg, B, 16), jnp.asarray([7, 2, 5]))
    extended = model.apply({"params": params}, extension, prefilled[1], jnp.asarray([3, 1, 2]),
                           jnp.asarray([[2], [0], [1]]))
    return prefilled, extended, model.apply({"params": params}, step, extended[1])


# CI time: q/k norms and sliding windows run the same layer code in both layouts
@pytest.mark.parametrize("name", ["llama"] + [pytest.param(n, marks=pytest.mark.slow)
                                              for n in ("qwen2", "qwen3", "mistral")])
def test_decoding_layouts_match_the_stacked_layout(name):
    cfg = CONFIGS[name]
    params = random_params(cfg)
    rng = np.random.default_rng(1)
    tokens = [jnp.asarray(rng.integers(3, cfg.vocab_size, (3, T)), jnp.int32) for T in (7, 3, 1)]
    stacked = prefill_extend_step(cfg, params, *tokens)
    for fuse, pack in LAYOUTS:
        dcfg, dparams = decoding_params(cfg, params, fuse, pack)
        assert dcfg.unroll_layers and dcfg.fuse_projections == (fuse or pack) and dcfg.pack_weights == pack
        for a, b in zip(stacked, prefill_extend_step(dcfg, dparams, *tokens)):
            assert_same_outputs(a, b)


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an LM head of its own; tied embeddings and q/k/v biases
def test_decoding_params_layout(name):
    """The converted tree is the one the decoding layout initialises (names and shapes) and keeps the entries the
    drafter reads (the packed layout holds the embedding and an LM head of its own as panels, the embedding's of
    its transpose); converting again to the same layout
    changes nothing, to any other one and back gives the same weights (one copy of the weights serves every layout:
    LoadedTarget.use_decoding_layout)."""
    cfg = CONFIGS[name]
    params = random_params(cfg)
    shapes = lambda tree: jax.tree.map(lambda w: (w.shape, w.dtype), tree)
    kept = ["embed", "final_norm"] + ([] if cfg.tie_embeddings else ["lm_head"])
    for fuse, pack in LAYOUTS:
        dcfg, dparams = decoding_params(cfg, params, fuse, pack)
        assert shapes(dparams) == shapes(target_shapes(dcfg))
        assert sorted(dparams) == sorted(kept + [f"layers_{i}" for i in range(cfg.num_layers)])
        assert all(dparams[k] is params[k] for k in kept if not (pack and k in ("embed", "lm_head")))
        if pack:
            np.testing.assert_array_equal(unpack_columns(dparams["embed"]["panels"], cfg.vocab_size),
                                          params["embed"]["embedding"].T)
        if pack and not cfg.tie_embeddings:
            np.testing.assert_array_equal(unpack_columns(dparams["lm_head"]["panels"], cfg.vocab_size),
                                          params["lm_head"]["kernel"])
        again = decoding_params(dcfg, dparams, fuse, pack)
        assert again[0] == dcfg and again[1] is dparams
        for other_layout in LAYOUTS:
            other_cfg, other = decoding_params(dcfg, dparams, *other_layout)
            assert shapes(other) == shapes(target_shapes(other_cfg))
            back_cfg, back = decoding_params(other_cfg, other, fuse, pack)
            assert back_cfg == dcfg and jax.tree.all(jax.tree.map(np.array_equal, back, dparams))
        plain = dataclasses.replace(dcfg, unroll_layers=False, fuse_projections=False, pack_weights=False)
        assert hash(dcfg) != hash(cfg) and plain == cfg


def test_fused_kernels_shard_like_the_separate_ones():
    """Tensor parallelism splits the fused q/k/v kernel by KV head and the fused gate/up kernel by MLP unit."""
    cfg = CONFIGS["qwen2"]
    _, dparams = decoding_params(cfg, random_params(cfg), fuse=True)
    dcfg = dataclasses.replace(cfg, unroll_layers=True, fuse_projections=True)
    mesh = AbstractMesh((1, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)
    layer = param_shardings(dparams, target_axes(dcfg), mesh)["layers_0"]
    assert layer["attn"]["qkv"]["kernel"].spec == P("fsdp", "tensor", None, None)
    assert layer["attn"]["qkv"]["bias"].spec == P("tensor", None, None)
    assert layer["mlp"]["gate_up"]["kernel"].spec == P("fsdp", None, "tensor")
