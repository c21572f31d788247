"""Distilled data as training and evaluation read it: the manifest, the records, their checks, and the held-out split.

A directory written by `specformer distill` (distill.py) holds:
  manifest.json       the settings the data was made with, and which shards are done (`complete` once all are)
  shard-00000.jsonl   one record per prompt: {"index": i, "input_ids": prompt_ids + answer_ids, "prompt_len": n}
`specformer pack-data` (packed.py) writes the same records as compressed token arrays, shard-00000.npz, ...
("shard_format": "npz" in the manifest), which every reader here reads alike.

Data made with purpose "eval" (`distill --for-eval`) may hold evaluation prompts and serves only to measure drafters:
training refuses it. The held-out split is by prompt index (a hash), so it is stable when the data grows.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_json, read_text

MANIFEST = "manifest.json"
FORMAT = "specformer-distill-v1"
PURPOSES = ("train", "eval")


def shard_name(k: int, shard_format: str = "jsonl") -> str:
    return f"shard-{k:05d}.{shard_format}"


def shard_path(out_dir: Path, k: int, shard_format: str = "jsonl") -> Path:
    return Path(out_dir) / shard_name(k, shard_format)


def manifest_setting(manifest: dict, key: str):
    return manifest.get(key, "train" if key == "purpose" else None)  # manifests before "purpose" hold training data


def read_manifest(out_dir: Path) -> dict | None:
    """The manifest of `out_dir`, or None if it has none."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecformerError(f"{path} is not a {FORMAT} manifest")
    return manifest


def read_distilled(out_dir: str | Path, allow_partial: bool = False, for_training: bool = False) -> list[dict]:
    """All records of a distillation run, in prompt order.

    Raises SpecformerError if the run is unfinished, unless allow_partial=True: then the records of the shards
    done so far are returned (check `len(...)` against the manifest's num_prompts to tell). for_training: refuse
    data made for evaluation (`purpose="eval"`).
    """
    out_dir = Path(out_dir)
    if not out_dir.exists():
        raise SpecformerError(f"data directory {out_dir} does not exist")
    manifest = read_manifest(out_dir)
    if manifest is None:
        raise SpecformerError(f"{out_dir} has no {MANIFEST}; it is not the output of `specformer distill`")
    if for_training and manifest_setting(manifest, "purpose") != "train":
        raise SpecformerError(f"{out_dir} was distilled with --for-eval: it may hold evaluation prompts and serves "
                              "only to measure drafters (eval_data); train on data distilled without --for-eval")
    if not manifest["complete"] and not allow_partial:
        raise SpecformerError(
            f"{out_dir} is unfinished ({len(manifest['shards_done'])} of {manifest['num_shards']} shards); "
            "rerun `specformer distill` with the same arguments to finish it"
        )
    shard_format = manifest.get("shard_format", "jsonl")  # "npz": packed (packed.py)
    records = []
    for k in manifest["shards_done"]:
        path = shard_path(out_dir, k, shard_format)
        if not path.is_file():
            raise SpecformerError(f"{path} is listed in {MANIFEST} but missing")
        records += _shard_records(path, shard_format)
    return records


def _shard_records(path: Path, shard_format: str) -> list[dict]:
    if shard_format == "npz":
        return _packed_records(path)
    return [_record(path, n, line) for n, line in enumerate(read_text(path).splitlines(), 1)]


def _record(path: Path, n: int, line: str) -> dict:
    """One shard line, checked for the fields readers use."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SpecformerError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not (isinstance(rec, dict) and isinstance(rec.get("index"), int) and isinstance(rec.get("input_ids"), list)
            and isinstance(rec.get("prompt_len"), int)):
        raise SpecformerError(f"{path}:{n}: not a distilled record (index, input_ids, prompt_len)")
    return rec


def _packed_records(path: Path) -> list[dict]:
    """The records of one packed shard (packed.py), checked as `_record` checks a JSONL line."""
    try:
        with np.load(path) as z:
            tokens, lengths, prompt_len, index = (z[k] for k in ("tokens", "lengths", "prompt_len", "index"))
    except (OSError, ValueError, KeyError) as e:
        raise SpecformerError(f"{path}: not a packed shard ({e})") from None
    if not (len(lengths) == len(prompt_len) == len(index) and int(lengths.sum()) == len(tokens)
            and (lengths >= prompt_len).all()):
        raise SpecformerError(f"{path}: a damaged packed shard (its lengths do not add up)")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return [{"index": int(i), "input_ids": tokens[s: s + n].tolist(), "prompt_len": int(p)}
            for i, s, n, p in zip(index, starts, lengths, prompt_len)]


def data_dirs(dirs: str | None, setting: str = "data") -> list[Path]:
    """The directories of a `data` / `eval_data` / `states` setting ("dir1,dir2"); one named twice is refused (its
    records would count twice)."""
    paths = [Path(d.strip()) for d in (dirs or "").split(",") if d.strip()]
    seen: dict[Path, Path] = {}
    for p in paths:
        first = seen.setdefault(p.resolve(), p)
        if first is not p:
            also = f" (also as {first})" if str(first) != str(p) else ""
            raise SpecformerError(f"{setting} names {p} twice{also}: its records would count twice")
    return paths


def load_records(dirs: str, setting: str = "data", for_training: bool = True) -> list[dict]:
    """The records of one directory written by `specformer distill`, or of several given as "dir1,dir2" (in order;
    each keeps its own prompt indices, so its held-out split is the one eval-drafter uses on it alone)."""
    paths = data_dirs(dirs, setting)
    if not paths:
        raise SpecformerError(f"no data: set `{setting}` to a directory written by `specformer distill` "
                              "(several: dir1,dir2)")
    return [r for d in paths for r in read_distilled(d, for_training=for_training)]


def _is_held_out(index: int, fraction: float) -> bool:
    """Deterministic held-out split by prompt index (stable when the data grows)."""
    h = int(hashlib.sha256(str(index).encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def split(records: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) by `_is_held_out`."""
    held = [_is_held_out(r["index"], fraction) for r in records]
    return [r for r, h in zip(records, held) if not h], [r for r, h in zip(records, held) if h]


def records_to_score(data: Path, train_config: dict | None, score_all: bool) -> list[dict]:
    """What eval-drafter scores in `data`: every record of data distilled --for-eval or when `score_all`, else those
    that the drafter's training run held out (its train_config's eval_fraction)."""
    records = read_distilled(data)
    if not score_all and manifest_setting(read_manifest(data), "purpose") != "eval":  # unseen data: score all
        fraction = (train_config or {}).get("eval_fraction")
        if fraction is None:
            raise SpecformerError("the drafter records no training split: pass --all to score every record")
        records = split(records, fraction)[1]
    if not records:
        raise SpecformerError(f"no records to score in {data}")
    return records


def check_vocabulary(out_dirs: list[Path], vocab_size: int) -> None:
    """Refuse data distilled from a target with another vocabulary (its manifest says; check_token_ids checks the
    records themselves)."""
    for d in out_dirs:
        theirs = (read_manifest(Path(d)) or {}).get("vocab_size")  # no manifest: read_distilled says so
        if theirs not in (None, vocab_size):
            raise SpecformerError(f"{d} was distilled from a target with a vocabulary of {theirs} tokens; this target "
                                  f"has {vocab_size}: distill data with this model")


def check_token_ids(records: list[dict], vocab_size: int, where: str = "records") -> None:
    """Refuse records holding token ids outside the vocabulary (they would train or score as NaN)."""
    try:
        low = min((min(r["input_ids"], default=0) for r in records), default=0)
        high = max((max(r["input_ids"], default=0) for r in records), default=0)
    except TypeError:
        raise SpecformerError(f"{where}: input_ids must be lists of integers") from None
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise SpecformerError(f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


def scored_positions(records: list[dict], seq_len: int, num_slots: int) -> int:
    """Positions that teacher-forced evaluation scores in `records` cut to seq_len tokens: those whose num_slots
    look-ahead tokens (t + 2 .. t + 1 + num_slots) are all answer tokens (training/loss.py counts the same)."""
    total = 0
    for r in records:
        end = min(len(r["input_ids"]), seq_len)  # answer tokens sit at [prompt_len, end)
        first, last = max(r["prompt_len"] - 2, 0), end - 2 - num_slots
        total += max(0, last - first + 1)
    return total


def check_scorable(records: list[dict], seq_len: int, num_slots: int, what: str = "the records") -> None:
    """Refuse evaluation data with no position to score (answers shorter than the slots within seq_len): its metrics
    would be zeros that look like results."""
    if not scored_positions(records, seq_len, num_slots):
        raise SpecformerError(f"{what}: no answer position has {num_slots} answer tokens after it within seq_len "
                              f"{seq_len}: nothing to score (raise seq_len, or distill longer answers)")
