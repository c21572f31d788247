"""SpecFormer speculative decoding in JAX/Flax: a Llama-family target, a SpecFormer drafter trained on the target's
own answers, and decoding that drafts K tokens per round, entirely on the device.

The public API is what this module exports (docs/decoding.md, docs/training.md); the submodules are the library's
layers: modeling (the Flax target and drafter), checkpoints (loading), decoding, training, bench, cli. Each name is
imported on first use, so a `specformer` command loads only the layers it runs.
"""

import importlib

_EXPORTS = {
    "AutoDraftLen": "specformer_jax.decoding.tuning.tuner",
    "DecodeOptions": "specformer_jax.decoding.options",
    "DecodeRecords": "specformer_jax.decoding.tuning.records",
    "DrafterConfig": "specformer_jax.config",
    "GenerationResult": "specformer_jax.decoding.api",
    "Hybrid": "specformer_jax.decoding.drafts.hybrid",
    "LoadedDrafter": "specformer_jax.checkpoints.drafter_io",
    "LoadedTarget": "specformer_jax.checkpoints.loader",
    "NgramDrafts": "specformer_jax.decoding.drafts.ngram",
    "SpecformerError": "specformer_jax.errors",
    "TargetConfig": "specformer_jax.config",
    "TrainConfig": "specformer_jax.training.train_config",
    "distill": "specformer_jax.training.data.distill",
    "evaluate_drafter": "specformer_jax.training.evaluate",
    "generate": "specformer_jax.decoding.api",
    "generate_stream": "specformer_jax.decoding.api",
    "load_drafter": "specformer_jax.checkpoints.drafter_io",
    "load_target": "specformer_jax.checkpoints.loader",
    "load_train_config": "specformer_jax.training.train_config",
    "read_distilled": "specformer_jax.training.data.dataset",
    "resolve_drafter": "specformer_jax.decoding.names",
    "sample_prompts": "specformer_jax.training.data.self_prompts",
    "train": "specformer_jax.training.trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specformer_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
