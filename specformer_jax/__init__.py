"""SpecFormer speculative decoding in JAX/Flax."""

from specformer_jax.checkpoints.loader import LoadedTarget, load_target
from specformer_jax.decoding.api import GenerationResult, generate
from specformer_jax.errors import SpecformerError

__all__ = ["GenerationResult", "LoadedTarget", "SpecformerError", "generate", "load_target"]
