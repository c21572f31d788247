"""Hugging Face tensor names -> the Target module's parameter tree (stacked layers, [in, out] kernels)."""

from __future__ import annotations

from typing import Callable

import ml_dtypes
import numpy as np

from specformer_jax.config import TargetConfig
from specformer_jax.errors import SpecformerError

# (our path inside 'layers', HF name inside 'model.layers.N.', transpose?)
_LAYER_MAP = [
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", True),
    (("input_norm", "scale"), "input_layernorm.weight", False),
    (("post_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp", "gate", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "up", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "down", "kernel"), "mlp.down_proj.weight", True),
]
_BIAS_MAP = [(("attn", p, "bias"), f"self_attn.{p}_proj.bias", False) for p in ("q", "k", "v")]
_QK_NORM_MAP = [(("attn", f"{p}_norm", "scale"), f"self_attn.{p}_norm.weight", False) for p in ("q", "k")]
_GLOBAL_MAP = [(("embed", "embedding"), "model.embed_tokens.weight"), (("final_norm", "scale"), "model.norm.weight"),
               (("lm_head", "kernel"), "lm_head.weight")]


def _set(tree: dict, path: tuple, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _hf_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """HF layer tensor name -> the shape the config implies ([out, in] for kernels)."""
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,),
    }


def params_from_hf(get: Callable[[str], np.ndarray], cfg: TargetConfig, source=None) -> dict:
    """Build the parameter tree from a getter of HF-named tensors (numpy, HF [out, in] layout).

    Every tensor's shape is checked against the config first; `source` (the checkpoint's path) prefixes errors.
    """
    dtype = np.float32 if cfg.dtype == "float32" else ml_dtypes.bfloat16
    where = f"{source}: " if source is not None else ""
    shapes = _hf_shapes(cfg)

    def fetch(name, shape, transpose=False):
        try:
            x = np.asarray(get(name))
        except KeyError:
            raise SpecformerError(f"{where}checkpoint is missing tensor {name!r}") from None
        if x.shape != shape:
            raise SpecformerError(f"{where}tensor {name} has shape {x.shape}; the config implies {shape}")
        return (x.T if transpose else x).astype(dtype)

    layer_map = _LAYER_MAP + (_BIAS_MAP if cfg.qkv_bias else []) + (_QK_NORM_MAP if cfg.qk_norm else [])
    embed = (cfg.vocab_size, cfg.hidden_size)
    params: dict = {}
    _set(params, ("embed", "embedding"), fetch("model.embed_tokens.weight", embed))
    _set(params, ("final_norm", "scale"), fetch("model.norm.weight", (cfg.hidden_size,)))
    if not cfg.tie_embeddings:
        _set(params, ("lm_head", "kernel"), fetch("lm_head.weight", embed, transpose=True))
    for path, name, transpose in layer_map:
        layers = [fetch(f"model.layers.{i}.{name}", shapes[name], transpose) for i in range(cfg.num_layers)]
        _set(params, ("layers",) + path, np.stack(layers))
    return params


def hf_name(path: tuple[str, ...], layer: int | None = None) -> str:
    """The Hugging Face name of the tensor behind a parameter of our tree (`layer`: which one of stacked layers)."""
    for ours, name in _GLOBAL_MAP:
        if path == ours:
            return name
    for ours, name, _ in _LAYER_MAP + _BIAS_MAP + _QK_NORM_MAP:
        if path == ("layers",) + ours:
            return f"model.layers.{layer}.{name}"
    return "/".join(path)
