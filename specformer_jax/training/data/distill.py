"""Writing self-distillation data: the target model's own greedy answers to training prompts, as resumable shards
(the layout, and everything that reads it, is in dataset.py).

Data made with `purpose="eval"` may hold evaluation prompts (the benchmark prompts) and serves only to measure a
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

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import Prompt, check_fits, checked_prompts, encode_prompts
from specformer_jax.errors import SpecformerError
from specformer_jax.files import write_atomic
from specformer_jax.modeling.loaded import LoadedTarget, checked_target
from specformer_jax.training.data.dataset import FORMAT, MANIFEST, PURPOSES, manifest_setting, read_manifest, shard_name
from specformer_jax.training.data.prompts import evaluation_prompts, is_evaluation_prompt

# Manifest fields that must match for a rerun to add to existing shards. batch_size is not among them: it changes
# throughput only, so a resumed run may use another one.
SETTINGS = ("format", "model", "dtype", "vocab_size", "max_new_tokens", "chat", "shard_size", "num_prompts",
            "prompts_sha256", "purpose")


def _prompts_sha256(prompt_ids: Sequence[Sequence[int]]) -> str:
    # Hash the token ids the model sees, so a changed tokenizer or chat template counts as a different prompt list.
    return hashlib.sha256(json.dumps([list(p) for p in prompt_ids]).encode()).hexdigest()


def _check_not_evaluation(prompts: Sequence[Prompt]) -> None:
    """Refuse text prompts from the evaluation set: training on them would inflate measured acceptance."""
    evaluation = evaluation_prompts()
    for i, p in enumerate(prompts):
        if isinstance(p, str) and is_evaluation_prompt(p, evaluation):
            raise SpecformerError(
                f"prompt {i} ({p[:60]!r}) is a benchmark prompt (specformer_jax/assets/"
                f"{', '.join(path.name for path in PROMPT_SETS.values())}); "
                "evaluation prompts must not be used as training data"
            )


def _open_out_dir(out_dir: Path, settings: dict) -> None:
    """Create `out_dir`, or check that the data already in it was made with the same settings."""
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecformerError(f"output path {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    old = read_manifest(out_dir)
    if old is None:
        if any(out_dir.iterdir()):
            raise SpecformerError(f"output directory {out_dir} is not empty and has no {MANIFEST}; pick a new --out")
        return
    if old.get("shard_format", "jsonl") != "jsonl":
        raise SpecformerError(f"{out_dir} holds packed data (`specformer pack-data`); pick a new --out")
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
    model, prompts = checked_target(model), checked_prompts(prompts)
    max_new_tokens = POSITIVE_INT.check("max_new_tokens", max_new_tokens)  # checked before the manifest is written
    batch_size = POSITIVE_INT.check("batch_size", batch_size)
    shard_size = POSITIVE_INT.check("shard_size", shard_size)
    if purpose not in PURPOSES:
        raise SpecformerError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    if purpose == "train":
        _check_not_evaluation(prompts)
    prompt_ids = encode_prompts(model, prompts, chat)
    # generate() checks this too, but only when it reaches the prompt's shard, possibly hours into the run
    check_fits(prompt_ids, max_new_tokens, model.cfg.max_position, "positions but the model's context is")
    out_dir = Path(out_dir)
    settings = {
        "format": FORMAT, "model": str(Path(model.source).resolve()), "dtype": model.cfg.dtype,
        "vocab_size": model.cfg.vocab_size, "max_new_tokens": max_new_tokens, "chat": chat, "shard_size": shard_size,
        "num_prompts": len(prompt_ids), "prompts_sha256": _prompts_sha256(prompt_ids), "purpose": purpose,
    }
    _open_out_dir(out_dir, settings)
    shards = [prompt_ids[k : k + shard_size] for k in range(0, len(prompt_ids), shard_size)]
    done = set(write_manifest(out_dir, settings, len(shards)))
    if progress and done:
        print(f"specformer: resuming {out_dir}: {len(done)} of {len(shards)} shards already done", file=sys.stderr)
    t0 = time.perf_counter()
    generated, run_s = _write_shards(model, out_dir, settings, shards, done, batch_size, progress)
    return {
        "out_dir": str(out_dir),
        "num_prompts": len(prompt_ids),
        "num_shards": len(shards),
        "shards_written": len(shards) - len(done),
        "shards_skipped": len(done),
        "num_generated": generated,
        "tokens_per_second": generated / run_s if run_s else 0.0,  # decode time only; compilation left out
        "seconds": time.perf_counter() - t0,
    }


def _write_shards(model: LoadedTarget, out_dir: Path, settings: dict, shards: list[list], done: set[int],
                  batch_size: int, progress: bool) -> tuple[int, float]:
    """Decode and write the shards not `done`, batch_size // shard_size of them at a time (at least one); the
    manifest is rewritten after each group. Returns (tokens generated, seconds decoding)."""
    shard_size = settings["shard_size"]
    already = sum(len(shards[k]) for k in done)
    pending = [k for k in range(len(shards)) if k not in done]
    group = max(1, batch_size // shard_size)  # shards decoded together, so a batch can be larger than a shard
    generated, run_s = 0, 0.0
    with tqdm(total=settings["num_prompts"], initial=already, unit="prompt", file=sys.stderr,
              disable=not progress) as bar:
        for g in range(0, len(pending), group):
            ks = pending[g : g + group]
            result = generate(model, [p for k in ks for p in shards[k]], max_new_tokens=settings["max_new_tokens"],
                              temperature=0.0, batch_size=batch_size)
            start = 0
            for k in ks:
                answers = result.token_ids[start : start + len(shards[k])]
                write_atomic(out_dir / shard_name(k), shard_text(k * shard_size, shards[k], answers))
                start += len(shards[k])
            write_manifest(out_dir, settings, len(shards))
            generated += result.stats["num_generated"]
            run_s += result.stats["run_seconds"]
            bar.update(start)
            bar.set_postfix_str(f"{generated / run_s if run_s else 0.0:.1f} tok/s")
    return generated, run_s
