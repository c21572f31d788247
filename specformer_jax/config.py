"""Frozen configuration dataclasses and their construction from Hugging Face configs and GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from pallas_kernels import IMPLS
from specformer_jax.checks import POSITIVE, POSITIVE_INT, is_int
from specformer_jax.errors import SpecformerError

# model_type -> which architectural switches it implies.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        for field, name in (("theta", "rope_theta"), ("factor", "factor"), ("low_freq_factor", "low_freq_factor"),
                            ("high_freq_factor", "high_freq_factor")):
            object.__setattr__(self, field, POSITIVE.check(name, getattr(self, field)))
        object.__setattr__(self, "original_max_position", POSITIVE_INT.check(
            "original_max_position_embeddings", self.original_max_position))

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Per-pair rotation frequencies (float64 numpy, static), with the configured scaling applied."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(medium, smoothed, scaled)
        return inv


# TargetConfig's integer fields -> the config.json keys they come from
_CONFIG_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position": "max_position_embeddings", "sliding_window": "sliding_window",
}


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shape and switches of a Llama-family decoder. Covers Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None  # Mistral v0.1
    model_type: str = "llama"
    dtype: str = "float32"  # parameter and activation dtype: float32 | bfloat16
    attention_impl: str = "auto"  # pallas_kernels.ragged_attention impl: auto | reference | pallas | interpret | ...
    # Parameter layout (modeling/target.py). Checkpoints and training: layers stacked and run under a scan, separate
    # q/k/v and gate/up. Decoding: `decoding_params` turns that into per-layer parameters (a Python loop over layers),
    # optionally with fused projections, and on CPUs packed for the CPU matmul kernels (pallas_kernels/cpu.py).
    unroll_layers: bool = False
    fuse_projections: bool = False
    pack_weights: bool = False

    def __post_init__(self):
        # Validated here, where configs from config.json and from GGUF metadata meet; messages name config.json keys.
        for field, key in _CONFIG_KEYS.items():
            if getattr(self, field) is not None or field not in ("head_dim", "sliding_window"):
                object.__setattr__(self, field, POSITIVE_INT.check(key, getattr(self, field)))
        object.__setattr__(self, "rms_norm_eps", POSITIVE.check("rms_norm_eps", self.rms_norm_eps))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise SpecformerError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                                      f"({self.num_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise SpecformerError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")
        if self.dtype not in ("float32", "bfloat16"):
            raise SpecformerError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.attention_impl not in IMPLS:
            raise SpecformerError(f"attention_impl must be one of {', '.join(IMPLS)}, got {self.attention_impl!r}")

    @property
    def attention(self) -> str:
        """The attention implementation the target runs: attention_impl, except that "auto" in the packed CPU
        decoding layout is the CPU kernel (pallas_kernels/cpu.py)."""
        return "cpu" if self.attention_impl == "auto" and self.pack_weights else self.attention_impl

    def hook_index(self, i: int) -> int:
        """Normalise a hidden-state hook index (HF convention: 0 = embeddings, L = final-normed output)."""
        n = self.num_layers + 1
        if not -n <= i < n:
            raise SpecformerError(f"hidden-state hook {i} is out of range for a {self.num_layers}-layer model")
        return i % n


def _get(cfg: Mapping[str, Any], *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _rope_from_hf(cfg: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 nests everything under rope_parameters; 4.x uses rope_theta + rope_scaling.
    merged = {}
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key) or {}, Mapping):
            raise SpecformerError(f"{key} must be an object, got {cfg[key]!r}")
        merged.update(cfg.get(key) or {})
    theta = _get(merged, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0))
    kind = merged.get("rope_type") or merged.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=merged["factor"])
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=merged["factor"],
            low_freq_factor=merged["low_freq_factor"],
            high_freq_factor=merged["high_freq_factor"],
            original_max_position=merged["original_max_position_embeddings"],
        )
    raise SpecformerError(f"unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)")


def target_config_from_hf(cfg: Mapping[str, Any], dtype: str | None = None) -> TargetConfig:
    """Build a TargetConfig from a parsed Hugging Face config.json (errors do not name the file: callers add it)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SpecformerError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        sliding = None
        if model_type == "mistral":
            sliding = cfg.get("sliding_window") or None
        elif cfg.get("use_sliding_window"):
            raise SpecformerError(f"{model_type} with use_sliding_window=true is not supported")
        if dtype is None:
            dtype = "bfloat16" if str(_get(cfg, "dtype", "torch_dtype", default="float32")) == "bfloat16" else "float32"
        return TargetConfig(  # TargetConfig checks the values
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=_get(cfg, "num_key_value_heads", default=cfg["num_attention_heads"]),
            head_dim=_get(cfg, "head_dim"),
            rms_norm_eps=_get(cfg, "rms_norm_eps", default=1e-6),
            rope=_rope_from_hf(cfg),
            max_position=_get(cfg, "max_position_embeddings", default=4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            model_type=model_type,
            dtype=dtype,
        )
    except KeyError as e:
        raise SpecformerError(f"missing required key {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """SpecFormer head on a frozen target. Sizes (heads, widths) follow the target, as in the paper's code."""

    num_slots: int = 4  # K: draft tokens per position; slot i at position t predicts token t + 2 + i
    hooks: tuple[int, ...] | None = None  # target hidden states to fuse; None = (0, L/2, L-1, L) (HF indexing)
    slot_attention: str = "bidirectional"  # the paper's design; "causal" (+ RoPE over slots) is the released code's
    intermediate_size: int | None = None  # SwiGLU width; None = the target's
    # Our extension, off in the paper's design: slots at t also see the embedding of token t + 1, which is known when
    # drafting (the target's own token: the one emitted after the accepted drafts).
    next_token_input: bool = False
    # The same token at the context layer, as EAGLE feeds it: position j fuses its hooked states with the embedding of
    # token j + 1 (known for every kept position: the accepted drafts, then the target's token), so the drafter's
    # cache holds (state, next token) pairs.
    context_token_input: bool = False
    # A reduced draft vocabulary: the head scores only the V' most frequent answer tokens of the training data (their
    # ids ship with the drafter as the "draft_vocab" parameter); None: the target's whole vocabulary.
    draft_vocab_size: int | None = None

    @property
    def reads_next_tokens(self) -> bool:
        """Whether drafting needs the token after each position (either input)."""
        return self.next_token_input or self.context_token_input

    def __post_init__(self):
        object.__setattr__(self, "num_slots", POSITIVE_INT.check("num_slots", self.num_slots))
        if isinstance(self.hooks, list):
            object.__setattr__(self, "hooks", tuple(self.hooks))
        if self.hooks is not None and not (isinstance(self.hooks, tuple) and all(map(is_int, self.hooks))):
            raise SpecformerError(f"hooks must be a list of integers, got {self.hooks!r}")
        if self.slot_attention not in ("bidirectional", "causal"):
            raise SpecformerError(f"slot_attention must be 'bidirectional' or 'causal', got {self.slot_attention!r}")
        for name in ("intermediate_size", "draft_vocab_size"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, POSITIVE_INT.check(name, getattr(self, name)))
        for name in ("next_token_input", "context_token_input"):
            if not isinstance(getattr(self, name), bool):
                raise SpecformerError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def resolved_hooks(self, target: TargetConfig) -> tuple[int, ...]:
        L = target.num_layers
        hooks = self.hooks if self.hooks is not None else (0, L // 2, L - 1, L)
        return tuple(target.hook_index(i) for i in hooks)
