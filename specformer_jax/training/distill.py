"""Self-distillation data: the target model's own greedy answers to training prompts, written as resumable shards.

Layout of `out_dir`:
  manifest.json       the settings the data was made with, and which shards are done (`complete` once all are)
  shard-00000.jsonl   one record per prompt: {"index": i, "input_ids": prompt_ids + answer_ids, "prompt_len": n}

Data made with `purpose="eval"` may hold evaluation prompts (benchmarks/prompts.jsonl) and serves only to measure a
drafter (`eval_data` of a training run, `specformer eval-drafter`): training refuses it.

Each shard and the manifest are replaced atomically, so an interrupted run leaves only whole shards behind and
loses at most the shard it was working on. Running again with the same arguments skips the shards already there.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import Prompt, encode_prompts
from specformer_jax.errors import SpecformerError
from specformer_jax.files import write_atomic
from specformer_jax.training.prompts import EVALUATION_PROMPTS, evaluation_prompts, is_evaluation_prompt

MANIFEST = "manifest.json"
FORMAT = "specformer-distill-v1"
# Manifest fields that must match for a rerun to add to existing shards. batch_size is not among them: it changes
# throughput only, so a resumed run may use another one.
SETTINGS = ("format", "model", "dtype", "vocab_size", "max_new_tokens", "chat", "shard_size", "num_prompts",
            "prompts_sha256", "purpose")
PURPOSES = ("train", "eval")


def manifest_setting(manifest: dict, key: str):
    return manifest.get(key, "train" if key == "purpose" else None)  # manifests before "purpose" hold training data


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.jsonl"


def prompts_sha256(prompt_ids: Sequence[Sequence[int]]) -> str:
    # Hash the token ids the model sees, so a changed tokenizer or chat template counts as a different prompt list.
    return hashlib.sha256(json.dumps([list(p) for p in prompt_ids]).encode()).hexdigest()


def check_not_evaluation(prompts: Sequence[Prompt]) -> None:
    """Refuse text prompts from the evaluation set: training on them would inflate measured acceptance."""
    evaluation = evaluation_prompts()
    for i, p in enumerate(prompts):
        if isinstance(p, str) and is_evaluation_prompt(p, evaluation):
            raise SpecformerError(
                f"prompt {i} ({p[:60]!r}) is an evaluation prompt from {EVALUATION_PROMPTS.name}; "
                "evaluation prompts must not be used as training data"
            )


def check_fits(model: LoadedTarget, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    # generate() checks this too, but only when it reaches the prompt's shard, possibly hours into the run.
    for i, p in enumerate(prompt_ids):
        if len(p) + max_new_tokens > model.cfg.max_position:
            raise SpecformerError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions but the model's context is {model.cfg.max_position}"
            )


def read_manifest(out_dir: Path) -> dict | None:
    """The manifest of `out_dir`, or None if it has none."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecformerError(f"{path} is not valid JSON ({e.msg})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecformerError(f"{path} is not a {FORMAT} manifest")
    return manifest


def open_out_dir(out_dir: Path, settings: dict) -> None:
    """Create `out_dir`, or check that the data already in it was made with the same settings."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecformerError(f"output path {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    old = read_manifest(out_dir)
    if old is None:
        if any(out_dir.iterdir()):
            raise SpecformerError(f"output directory {out_dir} is not empty and has no {MANIFEST}; pick a new --out")
        return
    for key in SETTINGS:
        there = manifest_setting(old, key)
        if there != settings[key]:
            raise SpecformerError(
                f"{out_dir} holds distillation data made with other settings ({key}: {there!r} there, "
                f"{settings[key]!r} now); rerun with the original arguments to resume, or pick a new --out"
            )


def write_manifest(out_dir: Path, settings: dict, num_shards: int) -> list[int]:
    """Record which shards exist (each was renamed into place whole, so existing means done); returns their indices."""
    done = [k for k in range(num_shards) if (out_dir / shard_name(k)).is_file()]
    manifest = {**settings, "num_shards": num_shards, "shards_done": done, "complete": len(done) == num_shards}
    write_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return done


def shard_text(start: int, prompt_ids: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> str:
    return "".join(
        json.dumps({"index": start + j, "input_ids": list(p) + list(a), "prompt_len": len(p)}) + "\n"
        for j, (p, a) in enumerate(zip(prompt_ids, answers))
    )


def distill(
    model: LoadedTarget,
    prompts: Sequence[Prompt],
    out_dir: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    chat: bool = True,
    shard_size: int = 64,
    progress: bool = True,
    purpose: str = "train",
) -> dict:
    """Greedy-decode every prompt with the target and write the results as shards of `shard_size` prompts.

    batch_size rows are decoded together: batch_size // shard_size shards at a time (at least one), so a batch size
    that is a multiple of shard_size uses it fully. An interruption loses at most the shards of the batch in flight.

    purpose: "train" (evaluation prompts refused) or "eval" (data to measure drafters on; training refuses it).

    Resumes when `out_dir` holds an unfinished run with the same settings; raises SpecformerError when it holds
    data made with other settings. Returns a summary of this run.
    """
    if not prompts:
        raise SpecformerError("no prompts given")
    max_new_tokens = POSITIVE_INT.check("max_new_tokens", max_new_tokens)  # checked before the manifest is written
    batch_size = POSITIVE_INT.check("batch_size", batch_size)
    shard_size = POSITIVE_INT.check("shard_size", shard_size)
    if purpose not in PURPOSES:
        raise SpecformerError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    if purpose == "train":
        check_not_evaluation(prompts)
    prompt_ids = encode_prompts(model, prompts, chat)
    check_fits(model, prompt_ids, max_new_tokens)
    out_dir = Path(out_dir)
    settings = {
        "format": FORMAT,
        "model": str(Path(model.source).resolve()),
        "dtype": model.cfg.dtype,
        "vocab_size": model.cfg.vocab_size,
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "shard_size": shard_size,
        "num_prompts": len(prompt_ids),
        "prompts_sha256": prompts_sha256(prompt_ids),
        "purpose": purpose,
    }
    open_out_dir(out_dir, settings)
    num_shards = -(-len(prompt_ids) // shard_size)
    done = set(write_manifest(out_dir, settings, num_shards))
    skipped = len(done)
    already = sum(len(prompt_ids[k * shard_size : (k + 1) * shard_size]) for k in done)
    if progress and skipped:
        print(f"specformer: resuming {out_dir}: {skipped} of {num_shards} shards already done", file=sys.stderr)
    generated, run_s, t0 = 0, 0.0, time.perf_counter()
    bar = tqdm(total=len(prompt_ids), initial=already, unit="prompt", file=sys.stderr, disable=not progress)
    pending = [k for k in range(num_shards) if k not in done]
    group = max(1, batch_size // shard_size)  # shards decoded together, so a batch can be larger than a shard
    with bar:
        for g in range(0, len(pending), group):
            shards = pending[g : g + group]
            chunks = [prompt_ids[k * shard_size : (k + 1) * shard_size] for k in shards]
            result = generate(model, [p for c in chunks for p in c], max_new_tokens=max_new_tokens, temperature=0.0,
                              batch_size=batch_size)
            start = 0
            for k, chunk in zip(shards, chunks):
                answers = result.token_ids[start : start + len(chunk)]
                write_atomic(out_dir / shard_name(k), shard_text(k * shard_size, chunk, answers))
                start += len(chunk)
            write_manifest(out_dir, settings, num_shards)
            generated += result.stats["num_generated"]
            run_s += result.stats["run_seconds"]
            bar.update(start)
            bar.set_postfix_str(f"{generated / run_s if run_s else 0.0:.1f} tok/s")
    return {
        "out_dir": str(out_dir),
        "num_prompts": len(prompt_ids),
        "num_shards": num_shards,
        "shards_written": num_shards - skipped,
        "shards_skipped": skipped,
        "num_generated": generated,
        "tokens_per_second": generated / run_s if run_s else 0.0,  # decode time only; compilation left out
        "seconds": time.perf_counter() - t0,
    }


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
    records = []
    for k in manifest["shards_done"]:
        path = out_dir / shard_name(k)
        if not path.is_file():
            raise SpecformerError(f"{path} is listed in {MANIFEST} but missing")
        records += [_record(path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1)]
    return records


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


def check_vocabulary(out_dirs: list[Path], vocab_size: int) -> None:
    """Refuse data distilled from a target with another vocabulary (its manifest says; check_token_ids checks the
    records themselves)."""
    for d in out_dirs:
        theirs = read_manifest(Path(d)).get("vocab_size")  # a hand-made manifest may lack it
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
