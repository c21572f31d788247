"""Random-weight targets of published shapes (`--model random:NAME`), for measuring speed at sizes no checkpoint of
which can reach the machine: a step's cost depends on the shapes, not on the weights' values.

The weights are drawn on the device by the model's own initialisers (no file is read), already in the decoding
layout (per-layer parameters, modeling/target.py), so an 8B model in bfloat16 takes its 16 GB once. The model has no
tokenizer and no EOS token: every answer runs to its token budget. Its text means nothing; what acceptance a drafter
would have is set apart (`set_acceptance` in decoding/api.py).
"""

from __future__ import annotations

import dataclasses

from specformer_jax.config import TargetConfig, target_config_from_hf
from specformer_jax.errors import SpecformerError

PREFIX = "random:"

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

# config.json values of the published models (and "tiny", for tests)
SHAPES: dict[str, dict] = {
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0)),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0)),
}


def is_random(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def random_config(spec: str, dtype: str | None = None) -> TargetConfig:
    """The config of `random:NAME` (bfloat16 unless dtype says otherwise), in the decoding layout."""
    name = spec[len(PREFIX):]
    if name not in SHAPES:
        raise SpecformerError(f"unknown random model {name!r}: choose one of {', '.join(SHAPES)}")
    cfg = target_config_from_hf(SHAPES[name], dtype or "bfloat16")
    return dataclasses.replace(cfg, unroll_layers=True)
