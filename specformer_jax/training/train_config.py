"""TrainConfig: one frozen dataclass for a drafter training run, loaded from YAML with `--set key=value` overrides."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path

import yaml

from pallas_kernels import IMPLS
from specformer_jax.config import DrafterConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.training.loss import OBJECTIVES


DRAFTER_SETTINGS = ("num_slots", "hooks", "slot_attention", "intermediate_size", "next_token_input")  # -> DrafterConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "default"  # target: default | HF dir | .gguf
    data: str = ""  # directory written by `specformer distill`; several: "dir1,dir2"
    out: str = "runs/drafter"  # checkpoints, metrics.jsonl, the exported drafter/
    eval_fraction: float = 0.02  # records held out (by prompt index) for periodic eval
    eval_data: str | None = None  # distilled data to evaluate on instead (e.g. `distill --for-eval` of unseen prompts)
    init_from: str | None = None  # a drafter directory to continue from (same drafter settings) instead of random init
    # drafter
    num_slots: int = 4
    hooks: tuple[int, ...] | None = None
    slot_attention: str = "bidirectional"
    intermediate_size: int | None = None  # the drafter's SwiGLU width; None = the target's
    next_token_input: bool = False  # slots also see the token after their position (our extension; see DrafterConfig)
    # data
    seq_len: int = 384  # prompt + answer, truncated; shorter ones padded
    batch_size: int = 8  # sequences per step (global, across all hosts)
    objective: str = "ce"  # per-slot loss: ce (the target's tokens, as the paper) | kl (the target's distributions)
    # optimisation (defaults: the paper's released recipe: AdamW, eps 1e-2, 5% warm-up, cosine to 1e-5)
    steps: int = 1000
    lr: float = 5e-4
    min_lr: float = 1e-5
    warmup_frac: float = 0.05
    adam_eps: float = 1e-2
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    # bookkeeping
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 8
    save_every: int = 200
    keep_checkpoints: int = 3
    chunk_positions: int = 256  # positions per LM-head chunk in the loss (memory vs speed)
    attention_impl: str = "auto"  # pallas_kernels.ragged_attention: auto = Pallas on GPU/TPU, reference on CPU
    mesh: str = "data=-1"  # device mesh, e.g. "data=2,fsdp=2,tensor=2" (-1: the remaining devices); see parallel.py

    def drafter(self) -> DrafterConfig:
        return DrafterConfig(**{k: getattr(self, k) for k in DRAFTER_SETTINGS})

    def __post_init__(self):
        hints = typing.get_type_hints(TrainConfig)
        for field in dataclasses.fields(self):  # types first (from YAML, --set or Python), then ranges
            object.__setattr__(self, field.name, _coerce(field.name, getattr(self, field.name), hints[field.name]))
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise SpecformerError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_positions < 1 or self.eval_batches < 0:
            raise SpecformerError(f"chunk_positions must be >= 1 and eval_batches >= 0 (0: no eval), got "
                                  f"{self.chunk_positions} and {self.eval_batches}")
        if not 0 <= self.eval_fraction < 1:
            raise SpecformerError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        bounds = {"lr": (self.lr > 0, "> 0"), "adam_eps": (self.adam_eps > 0, "> 0"),
                  "grad_clip": (self.grad_clip > 0, "> 0"), "weight_decay": (self.weight_decay >= 0, ">= 0"),
                  "min_lr": (0 <= self.min_lr <= self.lr, f"in [0, lr] = [0, {self.lr}]"),
                  "warmup_frac": (0 <= self.warmup_frac <= 1, "in [0, 1]")}
        for name, (ok, want) in bounds.items():  # NaN fails every comparison
            if not (ok and math.isfinite(getattr(self, name))):
                raise SpecformerError(f"{name} must be a finite number {want}, got {getattr(self, name)}")
        self.drafter()  # validates num_slots / slot_attention / intermediate_size
        if self.objective not in OBJECTIVES:
            raise SpecformerError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.attention_impl not in IMPLS:
            raise SpecformerError(f"attention_impl must be one of {', '.join(IMPLS)}, got {self.attention_impl!r}")


def _coerce(name: str, value, hint):
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType) else hint
    if value is None:
        return None
    if base is str and isinstance(value, os.PathLike):
        return os.fspath(value)
    if base is tuple or typing.get_origin(base) is tuple:
        ints = isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ints:
            raise SpecformerError(f"{name} must be a list of integers, got {value!r}")
        return tuple(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise SpecformerError(f"{name} must be {base.__name__}, got {value!r}")
    return value


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (a flat mapping of TrainConfig fields) plus `key=value` overrides (values parsed as YAML)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise SpecformerError(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise SpecformerError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise SpecformerError(f"{path} must hold a mapping of settings")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecformerError(f"--set expects key=value, got {item!r}")
        try:
            raw[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise SpecformerError(f"--set {item}: the value is not valid YAML") from None
    hints = typing.get_type_hints(TrainConfig)
    unknown = sorted(set(raw) - set(hints))
    if unknown:
        raise SpecformerError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(hints)}")
    return TrainConfig(**raw)  # which checks every value
