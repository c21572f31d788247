"""TrainConfig: one frozen dataclass for a drafter training run, loaded from YAML with `--set key=value` overrides."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path

import yaml

from pallas_kernels import IMPLS
from specformer_jax.checks import (
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    SEED,
    is_int,
    is_number,
    number,
)
from specformer_jax.config import DrafterConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_text
from specformer_jax.training.loss import OBJECTIVES

# The drafter's settings: DrafterConfig's fields, written among the run's own in YAML, --set and train_config.json.
DRAFTER_SETTINGS = tuple(f.name for f in dataclasses.fields(DrafterConfig))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a drafter training run (configs/*.yaml hold recipes); each value is checked on creation.
    The drafter's settings are its `drafter` config; YAML files, `--set` and train_config.json write them among the
    others, as one flat mapping (`settings`, `from_settings`): num_slots: 4."""

    model: str = "default"  # target: default | HF dir | .gguf
    data: str = ""  # directory written by `specformer distill`; several: "dir1,dir2"
    out: str = "runs/drafter"  # checkpoints, metrics.jsonl, the exported drafter/
    eval_fraction: float = 0.02  # records held out (by prompt index) for periodic eval
    eval_data: str | None = None  # distilled data to evaluate on instead (e.g. `distill --for-eval` of unseen prompts)
    states: str | None = None  # target states of `data` cached by `specformer cache-states`: train reads them;
    # several caches ("dir1,dir2") hold the data's records in order, e.g. one per data directory
    init_from: str | None = None  # a drafter to continue from (a directory or "default"; same drafter settings)
    drafter: DrafterConfig = DrafterConfig()  # the drafter to train (num_slots, hooks, ...: see DrafterConfig)
    # data
    seq_len: int = 384  # prompt + answer, truncated; shorter ones padded
    batch_size: int = 8  # sequences per step (global, across all hosts)
    objective: str = "ce"  # per-slot loss: ce (the target's tokens, as the paper) | kl (the target's distributions)
    slot_loss_decay: float = 0.0  # slot i's loss weighs exp(-decay * i), normalised (0: the slots' mean, as the paper)
    slot_loss_reach: bool = False  # also weigh it by the drafter's chance of drafting slots 0..i-1 right (loss.py)
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

    def __post_init__(self):
        if not isinstance(self.drafter, DrafterConfig):
            raise SpecformerError(f"drafter must be a DrafterConfig, got {type(self.drafter).__name__}")
        hints = typing.get_type_hints(TrainConfig)
        for field in dataclasses.fields(self):  # the types of text, flags and lists, then every number's range
            if field.name != "drafter":
                object.__setattr__(self, field.name, _coerce(field.name, getattr(self, field.name), hints[field.name]))
        lr = self.lr if is_number(self.lr) else None
        for name, kind in {**_NUMBERS, "min_lr": number(0, lr, what=f"a finite number in [0, lr] = [0, {lr}]")}.items():
            object.__setattr__(self, name, kind.check(name, getattr(self, name)))
        if self.objective not in OBJECTIVES:
            raise SpecformerError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.attention_impl not in IMPLS:
            raise SpecformerError(f"attention_impl must be one of {', '.join(IMPLS)}, got {self.attention_impl!r}")

    def settings(self) -> dict:
        """The run's settings as one flat mapping, the drafter's among them: what YAML files, `--set` and
        train_config.json hold."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out.update(dataclasses.asdict(value) if field.name == "drafter" else {field.name: value})
        return out

    @classmethod
    def from_settings(cls, settings: dict) -> "TrainConfig":
        """The config of a flat mapping of settings (`settings`' form); an unknown one is refused, naming the valid
        ones."""
        own = {f.name for f in dataclasses.fields(cls)} - {"drafter"}
        unknown = sorted(set(settings) - own - set(DRAFTER_SETTINGS))
        if unknown:
            raise SpecformerError(f"unknown setting(s) {', '.join(unknown)}; valid: {', '.join(cls().settings())}")
        drafter = DrafterConfig(**{k: v for k, v in settings.items() if k in DRAFTER_SETTINGS})  # checks them
        return cls(drafter=drafter, **{k: v for k, v in settings.items() if k in own})  # which checks the rest


# The numeric settings and the values each takes (min_lr: in [0, lr], checked with lr).
_NUMBERS = {
    **{name: POSITIVE_INT for name in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "save_every",
                                       "keep_checkpoints", "chunk_positions")},
    "eval_batches": NON_NEGATIVE_INT,  # 0: no periodic eval
    "seed": SEED,
    "eval_fraction": number(0, 1, below=True),
    "lr": POSITIVE, "adam_eps": POSITIVE, "grad_clip": POSITIVE, "weight_decay": NON_NEGATIVE, "warmup_frac": FRACTION,
    "slot_loss_decay": NON_NEGATIVE,
}


def _coerce(name: str, value, hint):
    """`value` of a setting whose type is `hint`, as YAML, `--set` or Python give it: paths as text, lists of
    integers as tuples, numbers written as text (YAML 1.1 reads 3e-4 as a string) as floats; numbers are left to
    _NUMBERS' checks."""
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if value is None or base is int or base is float and not isinstance(value, str):
        return value
    if base is str and isinstance(value, os.PathLike):
        return os.fspath(value)
    if base is tuple or typing.get_origin(base) is tuple:
        if not (isinstance(value, (list, tuple)) and all(map(is_int, value))):
            raise SpecformerError(f"{name} must be a list of integers, got {value!r}")
        return tuple(int(v) for v in value)
    if base is float:
        try:
            return float(value)
        except ValueError:
            return value  # refused by _NUMBERS with the setting's range
    if not isinstance(value, base):
        raise SpecformerError(f"{name} must be {'true or false' if base is bool else 'text'}, got {value!r}")
    return value


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (a flat mapping of settings, TrainConfig.settings' form) plus `key=value` overrides (values parsed as
    YAML)."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise SpecformerError(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
        try:
            raw = yaml.safe_load(read_text(path, "config file")) or {}
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
    return TrainConfig.from_settings(raw)
