"""SpecFormer speculative decoding in JAX/Flax."""

from specformer_jax.checkpoints.drafter_io import LoadedDrafter, load_drafter
from specformer_jax.checkpoints.loader import LoadedTarget, load_target
from specformer_jax.decoding.api import GenerationResult, generate
from specformer_jax.errors import SpecformerError

__all__ = ["GenerationResult", "LoadedDrafter", "LoadedTarget", "SpecformerError", "generate", "load_drafter",
           "load_target"]
