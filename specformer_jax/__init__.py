"""SpecFormer speculative decoding in JAX/Flax: a Llama-family target, a SpecFormer drafter trained on the target's
own answers, and decoding that drafts K tokens per round, entirely on the device.

The public API is what this module exports (docs/decoding.md, docs/training.md); the submodules are the library's
layers: modeling (the Flax target and drafter), checkpoints (loading), decoding, training, bench, cli.
"""

from specformer_jax.checkpoints.drafter_io import LoadedDrafter, load_drafter
from specformer_jax.checkpoints.loader import LoadedTarget, load_target
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.api import GenerationResult, generate
from specformer_jax.decoding.records import DecodeRecords
from specformer_jax.decoding.tuner import AutoDraftLen
from specformer_jax.errors import SpecformerError
from specformer_jax.training.dataset import read_distilled
from specformer_jax.training.distill import distill
from specformer_jax.training.evaluate import evaluate_drafter
from specformer_jax.training.self_prompts import sample_prompts
from specformer_jax.training.train_config import TrainConfig, load_train_config
from specformer_jax.training.trainer import train

__all__ = ["AutoDraftLen", "DecodeRecords", "DrafterConfig", "GenerationResult", "LoadedDrafter", "LoadedTarget",
           "SpecformerError", "TargetConfig", "TrainConfig", "distill", "evaluate_drafter", "generate",
           "load_drafter", "load_target", "load_train_config", "read_distilled", "sample_prompts", "train"]
