"""The models as decoding and training take them: a loaded target (config, parameters, tokenizer) and a loaded
drafter (config, DrafterParams and drafter.json's contents), with the checks that a value given as one is one and
that a drafter fits a target. The loaders (checkpoints/) make these values; the engine only reads them."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh

from pallas_kernels.cpu import build_cpu_kernels
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.files import cache_dir
from specformer_jax.modeling.drafter import DrafterParams, drafter_shapes
from specformer_jax.modeling.target import Target, decoding_params, target_axes
from specformer_jax.parallel import param_shardings

FINGERPRINT_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


@dataclasses.dataclass
class LoadedTarget:
    """A target model ready to run: config, parameters on the device, tokenizer (None if the checkpoint has none).

    One copy of the weights: decoding (`generate`) converts them to its layout in place (`use_decoding_layout`), so
    `cfg` tells the layout they are in now and `layout` names it; every layout computes the same function."""

    cfg: TargetConfig
    params: Any  # the Target module's 'params' tree, in cfg's layout
    tokenizer: Any | None
    eos_ids: tuple[int, ...]
    source: str

    def module(self, hooks=()) -> Target:
        return Target(self.cfg, tuple(hooks))

    @property
    def layout(self) -> str:
        """The layout the weights are in now: "stacked" (as loaded: one array per kind of weight over all layers,
        as checkpoints and training hold them), "per-layer", "fused" (q/k/v and gate/up fused, per layer) or
        "packed" (fused, as column panels for the CPU matmul kernels)."""
        if self.cfg.pack_weights:
            return "packed"
        return "fused" if self.cfg.fuse_projections else "per-layer" if self.cfg.unroll_layers else "stacked"

    def use_decoding_layout(self, pool_size: int, mesh: Mesh | None = None) -> LoadedTarget:
        """Hold the parameters in the decoding layout for a pool of `pool_size` rows (modeling/target.py,
        `decoding_params`): packed for the CPU matmul kernels on a CPU that has them (any pool size), else fused for
        a pool of one row; given a mesh, sharded over it by their logical axes. Converted in place, the old arrays
        dropped, so the weights live once whatever layouts calls ask for; `generate` calls this on the model it is
        given. A layout already held costs nothing. Returns the model, so that it can be converted at load time:
        `load_target(path).use_decoding_layout(8)`."""
        pack = mesh is None and cpu_kernels_ready(self.cfg)
        cfg, params = decoding_params(self.cfg, self.params, fuse=pool_size == 1, pack=pack)
        if mesh is not None:
            params = jax.device_put(params, param_shardings(params, target_axes(cfg), mesh))
        self.cfg, self.params = cfg, params
        return self


@dataclasses.dataclass
class LoadedDrafter:
    """A drafter ready to decode with: its config, its parameters (weights and draft vocabulary) on the device and
    drafter.json's contents."""

    cfg: DrafterConfig
    params: DrafterParams
    meta: dict  # drafter.json contents (training recipe, target source, eval numbers when recorded)
    sha256: str | None = None  # of params.safetensors when loaded from a directory: which weights a result used


def cpu_kernels_ready(cfg: TargetConfig) -> bool:
    """Whether a float32 model on the CPU decodes with the CPU matmul kernels (pallas_kernels/cpu.py): built once per
    machine under the cache directory; SPECFORMER_CPU_KERNELS=0 turns them off. A build that fails says why, once,
    and decoding runs XLA's matmuls."""
    if cfg.dtype != "float32" or jax.default_backend() != "cpu" or os.environ.get("SPECFORMER_CPU_KERNELS") == "0":
        return False
    failure = build_cpu_kernels(cache_dir() / "kernels")
    if failure and not _said.get(failure):
        _said[failure] = True
        print(f"specformer: {failure}; decoding uses XLA's matmuls", file=sys.stderr)
    return failure is None


_said: dict[str, bool] = {}


def checked_target(model, what: str = "model") -> LoadedTarget:
    """`model` when it is a LoadedTarget, else one line saying what was expected."""
    if not isinstance(model, LoadedTarget):
        raise SpecformerError(f"{what} must be a loaded target (what load_target(path) returns), got "
                              f"{type(model).__name__} {model!r:.60}")
    return model


def target_fingerprint(cfg: TargetConfig) -> dict:
    """The target's shape as drafter.json records it: a drafter fits the targets with this fingerprint."""
    return {k: getattr(cfg, k) for k in FINGERPRINT_FIELDS}


def fingerprint_diff(recorded: dict, cfg: TargetConfig) -> str:
    """How a recorded fingerprint differs from `cfg`'s ("" when it does not)."""
    want = target_fingerprint(cfg)
    return "; ".join(f"{k}: drafter {recorded.get(k)!r} vs target {want[k]!r}" for k in FINGERPRINT_FIELDS
                     if recorded.get(k) != want[k])


def check_drafter_fits(drafter, target: TargetConfig) -> None:
    """Refuse a drafter that was made for another target (or is not a loaded drafter at all), before it reaches a
    Flax shape error deep inside decoding."""
    if not isinstance(drafter, LoadedDrafter):
        raise SpecformerError("drafter must be a loaded drafter (what resolve_drafter(name, model) or "
                              f"load_drafter(path, model) returns), got {type(drafter).__name__}")
    diff = fingerprint_diff(drafter.meta["target"], target) if drafter.meta.get("target") else ""
    if diff:
        raise SpecformerError(f"this drafter was made for a different target ({diff})")
    if not isinstance(drafter.params, DrafterParams):
        raise SpecformerError(f"drafter.params must be DrafterParams, got {type(drafter.params).__name__}")
    have = {name: w.shape for name, w in traverse_util.flatten_dict(drafter.params.weights, sep="/").items()}
    check_weights(have, target, drafter.cfg, "this drafter")
    if drafter.cfg.draft_vocab_size is not None or drafter.params.vocab is not None:
        checked_vocab(drafter.params.vocab, drafter.cfg, target, "this drafter")


def check_weights(have: dict[str, tuple], target: TargetConfig, cfg: DrafterConfig, where: str) -> dict:
    """Refuse weights (flat name -> shape) that are not those of a drafter with `cfg` on `target`: one missing or
    of another shape (a drafter for another target?), or one `cfg` does not describe (e.g. a token input the
    settings lack: decoding would drop it silently and run another drafter). Returns the expected shapes."""
    expected = traverse_util.flatten_dict(drafter_shapes(target, cfg).weights, sep="/")
    for name, spec in expected.items():
        if name not in have or tuple(have[name]) != tuple(spec.shape):
            raise SpecformerError(f"{where} does not fit the model: parameter {name} is missing or has the wrong "
                                  "shape (a drafter for another target?)")
    stray = sorted(set(have) - set(expected))
    if stray:
        raise SpecformerError(f"{where} holds parameters its drafter settings do not have: "
                              f"{', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}")
    return expected


def checked_vocab(ids, cfg: DrafterConfig, target: TargetConfig, where: str) -> np.ndarray:
    """A draft vocabulary's token ids, refused unless they are draft_vocab_size distinct ids of the target (and the
    settings have a draft vocabulary)."""
    if cfg.draft_vocab_size is None:
        raise SpecformerError(f"{where} holds parameters its drafter settings do not have: a draft vocabulary "
                              "(draft_vocab_size is not set)")
    ids = None if ids is None else np.asarray(ids)
    if ids is None or ids.shape != (cfg.draft_vocab_size,) or ids.dtype.kind not in "iu":
        raise SpecformerError(f"{where}: its draft vocabulary must hold {cfg.draft_vocab_size} token ids "
                              "(draft_vocab_size)")
    if ids.min() < 0 or ids.max() >= target.vocab_size or np.unique(ids).size != ids.size:
        raise SpecformerError(f"{where}: its draft vocabulary must hold distinct token ids of the target's "
                              f"vocabulary (0..{target.vocab_size - 1})")
    return ids.astype(np.int32)
