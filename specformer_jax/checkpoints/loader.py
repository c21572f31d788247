"""`load_target(path)`: one entry point for HF directories, GGUF files and the embedded default model."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import resolve as resolve_attention
from specformer_jax.checkpoints.convert import hf_name
from specformer_jax.checkpoints.default import default_model_path
from specformer_jax.checkpoints.gguf_io import gguf_name, load_gguf
from specformer_jax.checkpoints.hf import load_hf
from specformer_jax.checkpoints.random_weights import is_random, random_config
from specformer_jax.config import TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedTarget
from specformer_jax.modeling.target import init_target, target_shapes


def load_target(path: str | Path = "default", dtype: str | None = None, attention_impl: str = "auto") -> LoadedTarget:
    """Load a target: "default" (SmolLM2-135M-Instruct GGUF), a HF checkpoint directory, a .gguf file, or
    "random:NAME", random weights of a published shape (checkpoints/random_weights.py; no tokenizer, no EOS).

    dtype: "float32" or "bfloat16"; default: the checkpoint's dtype for HF directories, float32 for GGUF, bfloat16
    for random weights. attention_impl: see `pallas_kernels.ragged_attention` (auto: Pallas kernels on GPU/TPU, the
    reference on CPU).
    """
    if is_random(path):
        cfg = _with_attention(random_config(path, dtype), attention_impl)
        return LoadedTarget(cfg, init_target(cfg, jax.random.key(0)), None, (), path)
    path = checked_path("model", path)
    if str(path) == "default":
        path = default_model_path()
    path = path.expanduser()
    if not path.exists():
        raise SpecformerError(f"model path {path} does not exist")
    if path.is_dir():
        cfg, params, eos, tok = load_hf(path, dtype)
    elif path.suffix == ".gguf":
        cfg, params, eos, tok = load_gguf(path, dtype)
    else:
        raise SpecformerError(f"{path} is neither a checkpoint directory nor a .gguf file")
    _check_shapes(cfg, params, path)
    cfg = _with_attention(cfg, attention_impl)
    params = jax.tree.map(jnp.asarray, params)
    refuse_non_finite(params, path, hf_name if path.is_dir() else lambda p, layer: gguf_name(hf_name(p, layer)))
    return LoadedTarget(cfg, params, tok, eos, str(path))


def _with_attention(cfg: TargetConfig, attention_impl: str) -> TargetConfig:
    """`cfg` with its attention kernels chosen, refused in one line when they cannot run its head size here."""
    try:
        resolve_attention(attention_impl, cfg.head_dim)
    except ValueError as e:
        raise SpecformerError(str(e)) from None
    return dataclasses.replace(cfg, attention_impl=attention_impl)


def checked_path(what: str, path, expected: str = "a path or 'default'") -> Path:
    """`path` as a Path when it is text or a path-like object, else a one-line error naming `what` it is. Empty text
    is refused: Path("") is the current directory, which nobody means."""
    if not isinstance(path, (str, os.PathLike)):
        raise SpecformerError(f"{what} must be {expected}, got {path!r}")
    if not str(path).strip():
        raise SpecformerError(f"{what} is empty: give {expected}")
    return Path(path)


def refuse_non_finite(params, source, name: Callable[[tuple[str, ...], int | None], str]) -> None:
    """Refuse parameters holding NaN or infinite values, naming the tensor (`name`: its name from the tree path and,
    for stacked layers, the layer): they decode to silent garbage. One compiled reduction over every tensor, cheap
    next to reading the file; stacked layers (under "layers") are reduced per layer."""
    paths = [tuple(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    stacked = tuple(p[0] == "layers" for p in paths)
    for path, s, ok in zip(paths, stacked, jax.device_get(_finite(jax.tree.leaves(params), stacked))):
        bad = [i for i, good in enumerate(ok.reshape(-1)) if not good]
        if bad:
            raise SpecformerError(f"{source}: tensor {name(path, bad[0] if s else None)} holds NaN or infinite values")


@functools.partial(jax.jit, static_argnums=1)
def _finite(leaves, stacked: tuple[bool, ...]):
    """Per tensor: whether all its values are finite (per layer for stacked ones)."""
    return [jnp.isfinite(x).reshape(x.shape[0], -1).all(1) if s else jnp.isfinite(x).all()
            for x, s in zip(leaves, stacked)]


def _check_shapes(cfg: TargetConfig, params, path) -> None:
    """Compare loaded tensors with the shapes the config implies, so a mismatch is one clear line, not a trace."""
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(target_shapes(cfg))}
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(params)}
    for name, shape in want.items():
        if got.get(name) != shape:
            raise SpecformerError(f"{path}: parameter {name} has shape {got.get(name)}, config implies {shape}")
