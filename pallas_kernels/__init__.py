"""Attention kernels for SpecFormer's hybrid causal/bidirectional attention, with jnp references.

This package imports only jax. `ragged_attention` is the entry point the models call.
"""

from pallas_kernels.reference import ragged_attention_reference

ragged_attention = ragged_attention_reference

__all__ = ["ragged_attention", "ragged_attention_reference"]
