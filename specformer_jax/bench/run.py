"""`specformer bench`: for each batch size, plain and speculative decoding of the same prompts in one process.

Compilation is excluded: an untimed pass over the same rows compiles and runs every shape first. The timed runs then
come in `repeats` back-to-back pairs, plain and speculative in alternating order (AB BA AB ...); the speedup is the
median over the pairs of their ratio and each side's tokens/s the median of its runs, so a machine that slows down
for a while (a noisy neighbour, clock changes) slows both sides of a pair alike instead of one of them. Reports
tokens/s of both (and every run's), speedup, mean accepted length, per-slot acceptance, output equivalence (greedy:
fraction of identical rows), device and versions, and what `specformer report` needs for its roofline: model
bytes/FLOPs and the device's measured read bandwidth and matmul rate.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from typing import Callable

import flax
import jax

from specformer_jax.bench.roofline import measure_device, model_facts
from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import Prompt, encode_prompts
from specformer_jax.decoding.records import DecodeRecords
from specformer_jax.decoding.tuner import AutoDraftLen, check_draft_len, default_draft_len

# decode_steps: loop iterations (plain steps, speculative rounds)
KEEP = ("tokens_per_second", "run_seconds", "num_generated", "decode_steps", "draft_len", "draft_len_auto",
        "mean_accepted_length", "batch_accepted_length", "acceptance_rate_per_slot", "rounds")


def run_benchmark(model: LoadedTarget, drafter: LoadedDrafter | None, prompts: list[Prompt], *,
                  batch_sizes: list[int], draft_len: int | str | AutoDraftLen | None, max_new_tokens: int,
                  repeats: int = 3,
                  mesh=None, records: DecodeRecords | None = None, log=sys.stderr,
                  on_progress: Callable[[dict], None] | None = None) -> dict:
    """The result document; `on_progress` gets it after every batch size (with the rows done so far and
    "complete": false until the last), so a run cut short still leaves what it measured. `records`: where the
    speculative runs record what they measured, and where draft_len="auto" learns from (as `generate`)."""
    if drafter is not None:  # checked before the first (plain) pass, not after it
        draft_len = check_draft_len(drafter, draft_len, records)
    shown = ("auto" if isinstance(draft_len, AutoDraftLen) else draft_len if draft_len is not None
             else default_draft_len(drafter) if drafter else 0)
    doc = {
        "drafter_sha256": drafter.sha256 if drafter else None,  # `sha256sum params.safetensors` of the drafter
        "draft_len": shown,
        "mean_prompt_tokens": sum(map(len, encode_prompts(model, prompts))) / len(prompts),
        "model_facts": model_facts(model.cfg, drafter and drafter.cfg, model.params, drafter and drafter.params),
        "device_measured": measure_device(model.cfg.dtype),
        "dtype": model.cfg.dtype,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "num_prompts": len(prompts),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "num_devices": jax.device_count(),
        "mesh": dict(mesh.shape) if mesh is not None else None,
        "cpu_count": os.cpu_count(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": [],
        "complete": False,
    }
    for bs in batch_sizes:
        if log and isinstance(draft_len, AutoDraftLen):
            print(f"specformer bench: batch {bs}: choosing the draft length (the first time at a batch size, this "
                  f"compiles and times {drafter.cfg.num_slots + 1} decoding loops)", file=log)
        row = _batch_size_row(model, drafter, prompts, bs, repeats, dict(
            max_new_tokens=max_new_tokens, batch_size=bs, mesh=mesh, draft_len=draft_len, records=records))
        doc["results"].append(row)
        if log:
            spec = row.get("spec", {})
            speed = (f", speculative (k={spec['draft_len']}) {row['speedup']:.2f}x, "
                     f"AL {spec.get('mean_accepted_length', 1.0):.2f}") if spec else ""
            print(f"specformer bench: batch {bs}: AR {row['ar']['tokens_per_second']:.1f} tok/s{speed}", file=log)
        doc["complete"] = len(doc["results"]) == len(batch_sizes)
        if on_progress:
            on_progress(doc)
    return doc


def _batch_size_row(model, drafter, prompts: list[Prompt], batch_size: int, repeats: int, spec_kw: dict) -> dict:
    """Plain and speculative decoding of one batch size: an untimed pass that compiles and runs every shape, then
    `repeats` pairs in alternating order (AB BA AB ...), so a machine slowing down hits both sides."""
    # The prompt set is cycled so every batch is full: batch 64 decodes 64 rows even from 16 prompts.
    rows_in = [prompts[i % len(prompts)] for i in range(max(batch_size, len(prompts)))]
    kw = {"ar": dict(max_new_tokens=spec_kw["max_new_tokens"], batch_size=batch_size, mesh=spec_kw["mesh"])}
    if drafter is not None:
        kw["spec"] = dict(spec_kw, drafter=drafter)
    for side in kw:
        generate(model, rows_in, **kw[side])
    runs: dict[str, list] = {side: [] for side in kw}
    for i in range(repeats):
        for side in (list(kw) if i % 2 == 0 else list(kw)[::-1]):
            runs[side].append(generate(model, rows_in, **kw[side]))
    row: dict = {"batch_size": batch_size, "num_rows": len(rows_in)}
    for side, results in runs.items():
        last = results[-1].stats
        row[side] = {k: last[k] for k in KEEP if k in last}
        row[side]["tokens_per_second"] = statistics.median(r.stats["tokens_per_second"] for r in results)
        row[side]["run_seconds"] = statistics.median(r.stats["run_seconds"] for r in results)
        row[side]["tokens_per_second_runs"] = [r.stats["tokens_per_second"] for r in results]
    if "spec" in runs:  # the median over the pairs of runs, each taken back to back under the same conditions
        row["speedup"] = statistics.median(s.stats["tokens_per_second"] / a.stats["tokens_per_second"]
                                           for a, s in zip(runs["ar"], runs["spec"]))
        same = zip(runs["ar"][-1].token_ids, runs["spec"][-1].token_ids)
        row["output_equivalence"] = sum(a == b for a, b in same) / len(rows_in)
    return row
