"""Load a Hugging Face checkpoint directory: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specformer_jax.checkpoints.convert import params_from_hf
from specformer_jax.checkpoints.safetensors_io import read_safetensors
from specformer_jax.config import TargetConfig, target_config_from_hf
from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _read_json(path: Path) -> dict:
    doc = read_json(path, "checkpoint file")
    if not isinstance(doc, dict):
        raise SpecformerError(f"{path} must be a JSON object")
    return doc


def _config(directory: Path, dtype: str | None = None) -> TargetConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise SpecformerError(f"{directory} has no config.json: not a Hugging Face checkpoint directory")
    doc = _read_json(config_path)
    try:
        cfg = target_config_from_hf(doc)
    except SpecformerError as e:
        raise SpecformerError(f"{config_path}: {e}") from None
    return cfg if dtype is None else dataclasses.replace(cfg, dtype=dtype)  # a bad dtype is not the file's fault


def _tensors(directory: Path) -> dict:
    """All tensors by HF name, memory-mapped."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise SpecformerError(f"{index} names shard files that do not exist: {', '.join(missing)}")
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise SpecformerError(f"{directory} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    tensors: dict = {}
    for f in files:
        tensors.update(read_safetensors(directory / f))
    return tensors


def load_hf(directory: Path, dtype: str | None = None):
    """(config, params, eos_ids, tokenizer-or-None) from a checkpoint directory."""
    cfg = _config(directory, dtype)
    tensors = _tensors(directory)
    params = params_from_hf(tensors.__getitem__, cfg, source=directory)
    eos = _eos_ids(directory)
    tokenizer = _tokenizer(directory) if any((directory / f).is_file() for f in TOKENIZER_FILES) else None
    if tokenizer is not None and not eos and tokenizer.eos_token_id is not None:
        eos = (tokenizer.eos_token_id,)
    return cfg, params, eos, tokenizer


def _tokenizer(directory: Path):
    """The checkpoint's tokenizer; damaged tokenizer files are one-line errors naming the file."""
    from transformers import AutoTokenizer

    for name in TOKENIZER_FILES[:2]:  # the JSON ones
        if (directory / name).is_file():
            _read_json(directory / name)
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises many types for files it cannot use
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SpecformerError(f"cannot build a tokenizer from {directory}: {first}") from None


def _eos_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            eos = _read_json(path).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
