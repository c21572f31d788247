"""Save and load a trained drafter: a directory with drafter.json (config, target fingerprint, eval) and
params.safetensors."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from specformer_jax.assets import DEFAULT_DRAFTER
from specformer_jax.checkpoints.loader import LoadedTarget, checked_path, refuse_non_finite
from specformer_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.files import file_sha256, write_json
from specformer_jax.modeling.drafter import DRAFT_VOCAB, init_drafter

FINGERPRINT_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def target_fingerprint(cfg: TargetConfig) -> dict:
    return {k: getattr(cfg, k) for k in FINGERPRINT_FIELDS}


@dataclasses.dataclass
class LoadedDrafter:
    """A drafter ready to decode with: its config, parameters on the device and drafter.json's contents."""

    cfg: DrafterConfig
    params: dict
    meta: dict  # drafter.json contents (training recipe, target source, eval numbers when recorded)
    sha256: str | None = None  # of params.safetensors when loaded from a directory: which weights a result used


def save_drafter(path: str | Path, cfg: DrafterConfig, params, target: TargetConfig, *, dtype="bfloat16", meta=None):
    """Write the drafter directory; the weights in bfloat16 by default to keep the file small (a draft vocabulary's
    token ids stay int32)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
    write_safetensors(path / "params.safetensors", {
        k: np.asarray(v, np.int32) if k == DRAFT_VOCAB else np.asarray(v, np.float32).astype(np_dtype)
        for k, v in flat.items()})
    write_json(path / "drafter.json", {"drafter": dataclasses.asdict(cfg), "target": target_fingerprint(target),
                                        **(meta or {})})


def _drafter_dir(path: str | Path) -> Path:
    """A drafter directory ("default": the one shipped for the default model)."""
    path = checked_path("drafter", path)
    if str(path) == "default":
        if not (DEFAULT_DRAFTER / "drafter.json").is_file():
            raise SpecformerError("this installation ships no default drafter; pass a drafter directory")
        return DEFAULT_DRAFTER
    return path.expanduser()


def record_eval(path: str | Path, result: dict) -> Path:
    """Store evaluation numbers in the drafter's drafter.json (`--draft-len auto` reads its per-slot acceptance);
    returns that file's path."""
    meta_path = _drafter_dir(path) / "drafter.json"
    doc = json.loads(meta_path.read_text())
    doc["eval"] = result
    write_json(meta_path, doc)
    return meta_path


def _fingerprint_diff(recorded: dict, cfg: TargetConfig) -> str:
    want = target_fingerprint(cfg)
    return "; ".join(f"{k}: drafter {recorded.get(k)!r} vs target {want[k]!r}" for k in FINGERPRINT_FIELDS
                     if recorded.get(k) != want[k])


@functools.lru_cache(maxsize=16)
def _expected_params(target: TargetConfig, cfg: DrafterConfig) -> dict:
    """Flat name -> ShapeDtypeStruct of the parameters a drafter with `cfg` has on `target`."""
    return traverse_util.flatten_dict(jax.eval_shape(lambda: init_drafter(target, cfg, jax.random.key(0))), sep="/")


def check_drafter_fits(drafter, target: TargetConfig) -> None:
    """Refuse a drafter that was loaded for another target (or is not a loaded drafter at all), before it reaches
    a Flax shape error deep inside decoding."""
    if not isinstance(drafter, LoadedDrafter):
        raise SpecformerError(f"drafter must be what load_drafter(path, model) returns, got {type(drafter).__name__}")
    diff = _fingerprint_diff(drafter.meta["target"], target) if drafter.meta.get("target") else ""
    if diff:
        raise SpecformerError(f"this drafter was made for a different target ({diff})")
    have = traverse_util.flatten_dict(drafter.params, sep="/")
    expected = _expected_params(target, drafter.cfg)
    for name, spec in expected.items():
        if name not in have or tuple(have[name].shape) != tuple(spec.shape):
            raise SpecformerError(f"this drafter does not fit the model: parameter {name} is missing or has the "
                                  "wrong shape (a drafter for another target?)")
    _refuse_stray(set(have), expected, drafter.cfg, "this drafter")
    if drafter.cfg.draft_vocab_size is not None:
        _checked_vocab(have.get(DRAFT_VOCAB), drafter.cfg, target, "this drafter")


def _refuse_stray(names: set[str], expected: dict, cfg: DrafterConfig, where: str) -> None:
    """Refuse parameters that `cfg` does not describe (expected: its _expected_params; e.g. a draft vocabulary or
    token input that the config lacks: decoding would drop them silently and run another drafter)."""
    stray = sorted(names - set(expected) - ({DRAFT_VOCAB} if cfg.draft_vocab_size else set()))
    if stray:
        raise SpecformerError(f"{where} holds parameters its drafter settings do not have: "
                              f"{', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}")


def _checked_vocab(ids, cfg: DrafterConfig, target: TargetConfig, where: str) -> np.ndarray:
    """A draft vocabulary's token ids, refused unless they are draft_vocab_size distinct ids of the target."""
    ids = None if ids is None else np.asarray(ids)
    if ids is None or ids.shape != (cfg.draft_vocab_size,) or ids.dtype.kind not in "iu":
        raise SpecformerError(f"{where}: parameter {DRAFT_VOCAB} must hold {cfg.draft_vocab_size} token ids "
                              "(draft_vocab_size)")
    if ids.min() < 0 or ids.max() >= target.vocab_size or np.unique(ids).size != ids.size:
        raise SpecformerError(f"{where}: {DRAFT_VOCAB} must hold distinct token ids of the target's vocabulary "
                              f"(0..{target.vocab_size - 1})")
    return ids.astype(np.int32)


def load_drafter(path: str | Path, target: LoadedTarget) -> LoadedDrafter:
    """Load a drafter directory for `target` ("default": the one shipped for the default model; "random": fresh
    random weights of RANDOM_DRAFTER's shape, for measuring speed with `set_acceptance`).

    A drafter made for a different target is a clear error.
    """
    if str(path) == "random":
        return random_drafter(target)
    path = _drafter_dir(path)
    meta_path = path / "drafter.json"
    if not path.exists():
        raise SpecformerError(f"drafter {path} does not exist")
    if not meta_path.is_file():
        raise SpecformerError(f"{path} is not a drafter directory (no drafter.json)")
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
    diff = _fingerprint_diff(meta.get("target") or {}, target.cfg)
    if diff:
        raise SpecformerError(f"drafter {path} was made for a different target ({diff})")
    tensors = read_safetensors(path / "params.safetensors") if (path / "params.safetensors").is_file() else None
    if tensors is None:
        raise SpecformerError(f"{path} has no params.safetensors")
    expected = _expected_params(target.cfg, cfg)
    _refuse_stray(set(tensors), expected, cfg, f"{path}: params.safetensors")
    params = {}
    for name, spec in expected.items():
        if name not in tensors or tensors[name].shape != spec.shape:
            raise SpecformerError(f"{path}: parameter {name} is missing or has the wrong shape")
        params[name] = jnp.asarray(np.asarray(tensors[name], np.float32), spec.dtype)
    if cfg.draft_vocab_size is not None:
        params[DRAFT_VOCAB] = jnp.asarray(_checked_vocab(tensors.get(DRAFT_VOCAB), cfg, target.cfg, str(path)))
    params = traverse_util.unflatten_dict(params, sep="/")
    refuse_non_finite(params, path / "params.safetensors", lambda names, layer: "/".join(names))
    return LoadedDrafter(cfg, params, meta, file_sha256(path / "params.safetensors"))


RANDOM_DRAFTER = DrafterConfig(num_slots=8)  # the paper's K = 8; widths follow the target


def random_drafter(target: LoadedTarget, seed: int = 1) -> LoadedDrafter:
    """A drafter of RANDOM_DRAFTER's shape for `target`, its weights drawn on the device in the target's dtype: what
    a drafter of that size costs, whatever it would accept."""
    params = init_drafter(target.cfg, RANDOM_DRAFTER, jax.random.key(seed))
    meta = {"drafter": dataclasses.asdict(RANDOM_DRAFTER), "target": target_fingerprint(target.cfg), "random": True}
    return LoadedDrafter(RANDOM_DRAFTER, params, meta)
