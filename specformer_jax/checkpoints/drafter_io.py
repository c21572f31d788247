"""Save and load a trained drafter: a directory with drafter.json (config, target fingerprint, eval) and
params.safetensors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from specformer_jax.checkpoints.loader import checked_path, refuse_non_finite
from specformer_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.files import file_sha256, remove_temporaries, write_json
from specformer_jax.modeling.drafter import DrafterParams, init_drafter
from specformer_jax.modeling.loaded import (
    LoadedDrafter,
    LoadedTarget,
    check_weights,
    checked_target,
    checked_vocab,
    fingerprint_diff,
    target_fingerprint,
)

# params.safetensors holds the weights by their flattened names ("expand/kernel") and, for a drafter with a reduced
# draft vocabulary, its token ids under this name; drafter.json holds what that vocabulary covers under the same key.
VOCAB_KEY = "draft_vocab"


def save_drafter(path: str | Path, cfg: DrafterConfig, params: DrafterParams, target: TargetConfig, *,
                 dtype="bfloat16", meta=None, vocab_meta: dict | None = None):
    """Write the drafter directory; the weights in bfloat16 by default to keep the file small (a draft vocabulary's
    token ids stay int32). vocab_meta: what the draft vocabulary covers (training/draft_vocab.py, vocab_meta). A
    save that was killed before it finished left temporary files: this one removes them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("params.safetensors", "drafter.json"):
        remove_temporaries(path / name)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    flat = traverse_util.flatten_dict(jax.device_get(params.weights), sep="/")
    tensors = {k: np.asarray(v, np.float32).astype(np_dtype) for k, v in flat.items()}
    if params.vocab is not None:
        tensors[VOCAB_KEY] = np.asarray(params.vocab, np.int32)
    write_safetensors(path / "params.safetensors", dict(sorted(tensors.items())))  # name order, as always
    write_json(path / "drafter.json", {"drafter": dataclasses.asdict(cfg), "target": target_fingerprint(target),
                                        **(meta or {}), **({VOCAB_KEY: vocab_meta} if vocab_meta else {})})


def file_meta(meta: dict) -> dict:
    """drafter.json's entries that describe the file's own weights (settings, target, eval, draft vocabulary) left
    out: what a copy with other weights or another vocabulary keeps."""
    return {k: v for k, v in meta.items() if k not in ("drafter", "target", "eval", VOCAB_KEY)}


def drafter_dir(path: str | Path) -> Path:
    """`path` when it is a drafter directory (one holding drafter.json), else one line saying what it is. Names
    ("default", "ngram", ...) are read by decoding/names.py (resolve_drafter), not here."""
    path = checked_path("drafter", path, "a drafter directory").expanduser()
    if not path.exists():
        raise SpecformerError(f"drafter {path} does not exist (give a drafter directory; a drafter by name, such as "
                              "'default', is what resolve_drafter(name, model) loads)")
    if not (path / "drafter.json").is_file():
        raise SpecformerError(f"{path} is not a drafter directory (no drafter.json)")
    return path


def record_eval(path: str | Path, result: dict) -> Path:
    """Store evaluation numbers in the drafter directory's drafter.json (`--draft-len auto` reads its per-slot
    acceptance); returns that file's path."""
    meta_path = drafter_dir(path) / "drafter.json"
    doc = json.loads(meta_path.read_text())
    doc["eval"] = result
    write_json(meta_path, doc)
    return meta_path


def load_drafter(path: str | Path, target: LoadedTarget) -> LoadedDrafter:
    """Load the drafter directory `path` for `target`. A drafter by name (the shipped "default", "random" weights, the
    n-gram lookup, a hybrid) is what `resolve_drafter(name, target)` loads (decoding/names.py).

    A drafter made for a different target is a clear error.
    """
    checked_target(target, "target")
    path = drafter_dir(path)
    cfg, meta = _read_meta(path / "drafter.json")
    diff = fingerprint_diff(meta.get("target") or {}, target.cfg)
    if diff:
        raise SpecformerError(f"drafter {path} was made for a different target ({diff})")
    if not (path / "params.safetensors").is_file():
        raise SpecformerError(f"{path} has no params.safetensors")
    params = _read_params(path / "params.safetensors", cfg, target.cfg)
    return LoadedDrafter(cfg, params, meta, file_sha256(path / "params.safetensors"))


def _read_meta(meta_path: Path) -> tuple[DrafterConfig, dict]:
    """(the drafter's settings, drafter.json's contents), refused in one line when malformed."""
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise SpecformerError("not a JSON object")
        for key in ("drafter", "target", "eval"):
            if not isinstance(meta.get(key) or {}, dict):
                raise SpecformerError(f"{key} must be an object")
        cfg = DrafterConfig(**meta["drafter"])  # DrafterConfig checks the values
    except (ValueError, KeyError, TypeError, SpecformerError) as e:
        raise SpecformerError(f"{meta_path} is malformed: {e}") from None
    rates = (meta.get("eval") or {}).get("acceptance_rate_per_slot")  # read by `--draft-len auto`
    if rates is not None and not (isinstance(rates, list) and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates)):
        raise SpecformerError(f"{meta_path}: eval.acceptance_rate_per_slot must be numbers in [0, 1], got {rates!r}")
    return cfg, meta


def _read_params(file: Path, cfg: DrafterConfig, target: TargetConfig) -> DrafterParams:
    """The weights (in the target's dtype) and draft vocabulary of params.safetensors, checked against the settings:
    every weight of the right shape, none they do not describe, a vocabulary exactly when they have one."""
    tensors = read_safetensors(file)
    vocab = tensors.pop(VOCAB_KEY, None) if cfg.draft_vocab_size is not None else None
    expected = check_weights({name: t.shape for name, t in tensors.items()}, target, cfg, f"{file}")
    weights = {name: jnp.asarray(np.asarray(tensors[name], np.float32), spec.dtype) for name, spec in expected.items()}
    weights = traverse_util.unflatten_dict(weights, sep="/")
    refuse_non_finite(weights, file, lambda names, layer: "/".join(names))
    if cfg.draft_vocab_size is not None:
        vocab = jnp.asarray(checked_vocab(vocab, cfg, target, str(file.parent)))
    return DrafterParams(weights, vocab)


RANDOM_DRAFTER = DrafterConfig(num_slots=8)  # the paper's K = 8; widths follow the target


def random_drafter(target: LoadedTarget, seed: int = 1) -> LoadedDrafter:
    """A drafter of RANDOM_DRAFTER's shape for `target`, its weights drawn on the device in the target's dtype: what
    a drafter of that size costs, whatever it would accept."""
    params = init_drafter(target.cfg, RANDOM_DRAFTER, jax.random.key(seed))
    meta = {"drafter": dataclasses.asdict(RANDOM_DRAFTER), "target": target_fingerprint(target.cfg), "random": True}
    return LoadedDrafter(RANDOM_DRAFTER, params, meta)
