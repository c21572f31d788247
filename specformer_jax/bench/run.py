"""`specformer bench`: for each batch size (pool size), plain and speculative decoding of the same request stream
in one process, under one schedule or both (continuous and static batching).

Compilation is excluded: an untimed pass over the same requests compiles and runs every shape first. The timed runs
then come in `repeats` back-to-back rounds of every side in alternating order (AB BA AB ...); each ratio (speculative
over plain, continuous over static) is the median over the rounds of the two sides' ratio and each side's tokens/s
the median of its runs, so a machine that slows down for a while (a noisy neighbour, clock changes) slows both sides
alike instead of one of them. Reports tokens/s and requests/s of every side (and every run's), per-request latency
percentiles, speedup, mean and batch accepted length, per-slot acceptance, output equivalence (greedy: fraction of
identical requests), device and versions, and what `specformer report` needs for its roofline: model bytes/FLOPs
and the device's measured read bandwidth and matmul rate.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from typing import Callable

import flax
import jax
import numpy as np

from pallas_kernels import cpu
from specformer_jax.bench.roofline import kv_bytes_per_token, measure_device, model_facts
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.kinds import Drafter, kind_name, specformer_part
from specformer_jax.decoding.encode import Prompt, encode_prompts
from specformer_jax.decoding.tuning.draft_len import checked_draft_len
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.tuner import AutoDraftLen
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedTarget

# decode_steps: rounds with a live row (plain steps, speculative rounds); rounds_run: all rounds run
KEEP = ("tokens_per_second", "requests_per_second", "run_seconds", "num_generated", "decode_steps", "rounds_run",
        "draft_len", "draft_len_auto", "mean_accepted_length", "batch_accepted_length", "acceptance_rate_per_slot",
        "rounds", "latency_seconds", "pool_occupancy", "schedule", "chunk_rounds", "law_accepted_length", "by_source",
        "verify_budget", "verified_positions_per_round", "accepted_per_verified_draft", "rounds_without_drafts")


def cycled(prompts: list, n: int) -> list:
    """`n` requests: the prompts in order, from the first again when they run out."""
    return [prompts[i % len(prompts)] for i in range(n)]


def run_benchmark(model: LoadedTarget, drafter: Drafter | None, prompts: list[Prompt], *,
                  batch_sizes: list[int], draft_len: int | str | AutoDraftLen | None, max_new_tokens: int,
                  repeats: int = 3, num_requests: int | None = None, schedules: tuple[str, ...] = ("continuous",),
                  chunk_rounds: int | None = None, mesh=None, records: DecodeRecords | None = None, log: bool = True,
                  on_progress: Callable[[dict], None] | None = None, set_acceptance: list[float] | None = None,
                  drafter_name: str | None = None, verify_budget: str | int | None = None) -> dict:
    """The result document; `on_progress` gets it after every batch size (with the rows done so far and
    "complete": false until the last), so a run cut short still leaves what it measured. `records`: where the
    speculative runs record what they measured, and where draft_len="auto" learns from (as `generate`).
    `num_requests`: the prompts cycled to this many requests, each decoded to its natural length up to
    max_new_tokens (default: as many as the prompts, at least a full batch). `schedules`: the first is the row's
    "ar"/"spec"; a second one adds its own sides under its name, and ratios of the first over it.
    `set_acceptance`: rates; each batch size gets a row per rate, its speculative side decoded with acceptance set
    at that rate (decoding/api.py): a cost measurement, its text meaningless. A model without a tokenizer (random
    weights) decodes synthetic token-id prompts in place of text ones (`synthetic_prompts`). `log`: a line per row
    on stderr, and one before the first saying what will run (the drafter called `drafter_name`, default its kind).
    A batch size whose KV cache cannot fit in the free memory is refused before anything runs. verify_budget: the
    speculative side's positions per round, or "+N": the batch size plus N (as `generate`'s)."""
    prompts = synthetic_prompts(model, prompts)
    draft_len = checked_draft_len(drafter, draft_len, records)  # checked before the first (plain) pass, not after it
    ids, requests = encode_prompts(model, prompts), {bs: num_requests or max(bs, len(prompts)) for bs in batch_sizes}
    check_memory(model, ids, requests, max_new_tokens, mesh)
    if log:
        _announce(drafter_name or (kind_name(drafter) if drafter is not None else None), draft_len, requests,
                  max_new_tokens, repeats, schedules, len(set_acceptance or [None]))
    loaded = specformer_part(drafter)  # what weights it drafts with (none: the n-gram lookup)
    doc = {
        "drafter_sha256": loaded.sha256 if loaded else None,  # `sha256sum params.safetensors` of the drafter
        "draft_len": "auto" if isinstance(draft_len, AutoDraftLen) else "default" if draft_len is None else draft_len,
        "mean_prompt_tokens": sum(map(len, ids)) / len(ids),
        "model_facts": model_facts(model.cfg, loaded and loaded.cfg, model.params, loaded and loaded.params),
        "device_measured": measure_device(model.cfg.dtype),
        "dtype": model.cfg.dtype,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "num_requests": num_requests,
        "schedules": list(schedules),
        "num_prompts": len(prompts),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "num_devices": jax.device_count(),
        "mesh": dict(mesh.shape) if mesh is not None else None,
        "cpu_count": os.cpu_count(),
        "cpu_kernels_target": cpu.build_target(),  # -march of the CPU kernels (pallas_kernels/cpu.py)
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": [],
        "complete": False,
    }
    if set_acceptance:
        doc["set_acceptance"] = {"rates": list(set_acceptance), "note": SET_ACCEPTANCE_NOTE}
    for bs in batch_sizes:
        if log and isinstance(draft_len, AutoDraftLen):
            print(f"specformer bench: batch {bs}: choosing the draft length (the first time at a batch size, this "
                  f"compiles and times {drafter.cfg.num_slots + 1} engines)", file=sys.stderr)
        engine = dict(max_new_tokens=max_new_tokens, batch_size=bs, mesh=mesh, chunk_rounds=chunk_rounds)
        stream = cycled(prompts, requests[bs])
        for rate in set_acceptance or [None]:
            spec_kw = dict(draft_len=draft_len, records=records, set_acceptance=rate, verify_budget=verify_budget)
            row = _batch_size_row(model, drafter, stream, repeats, engine, spec_kw, schedules)
            doc["results"].append(row)
            if log:
                _log_row(row)
        doc["complete"] = bs == batch_sizes[-1]
        if on_progress:
            on_progress(doc)
    return doc


def _announce(drafter: str | None, draft_len, requests: dict[int, int], max_new_tokens: int, repeats: int,
              schedules: tuple[str, ...], rows_per_size: int) -> None:
    """Say what the run will decode before it starts (a large batch size runs for a long while)."""
    sizes = ", ".join(f"{bs} ({n:,} requests)" for bs, n in requests.items())
    k = ("k auto, chosen per batch size" if isinstance(draft_len, AutoDraftLen) else
         "k the default of each batch size" if draft_len is None else f"k = {draft_len}")
    sides = f"plain and speculative (drafter {drafter}, {k})" if drafter is not None else "plain"
    runs = 1 + repeats
    rows = f", {rows_per_size} rows per batch size" if rows_per_size > 1 else ""
    print(f"specformer bench: batch sizes {sizes}, up to {max_new_tokens} new tokens each; {sides} decoding under "
          f"{' and '.join(schedules)}, each side {runs} times (one untimed){rows}", file=sys.stderr)


def check_memory(model: LoadedTarget, ids: list[list[int]], requests: dict[int, int], max_new_tokens: int,
                 mesh=None) -> None:
    """Refuse, before anything runs, a batch size whose KV cache alone cannot fit in the memory free for it (the
    device's, on a CPU the host's): it would fail after minutes of decoding the smaller ones, or swap."""
    free = free_memory(mesh)
    if free is None:
        return
    positions = max(map(len, ids)) + max_new_tokens
    row = kv_bytes_per_token(model.cfg) * positions
    for bs, count in requests.items():
        need = min(bs, count) * row
        if need > free:
            raise SpecformerError(f"batch size {bs} cannot run here: its KV cache alone takes {need / 2**30:,.1f} "
                                  f"GiB ({min(bs, count):,} rows of {positions} positions), and {free / 2**30:,.1f} "
                                  f"GiB are free on the {_where(mesh)} (room for {free // row:,} rows)")


def free_memory(mesh=None) -> int | None:
    """Bytes free for decoding's caches: on a CPU the host's available memory; else, on the first device or every
    device of `mesh`, its limit less what it holds. None where the platform does not say."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if devices[0].platform == "cpu":
        return host_available_memory()
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in s for s in stats):
        return None
    return sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)


def host_available_memory() -> int | None:
    """The host's available memory (Linux's MemAvailable: free memory and caches it can drop), else its total."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):
            return None


def _where(mesh) -> str:
    device = jax.devices()[0]
    if device.platform == "cpu":
        return "host"
    return f"{mesh.devices.size} devices of the mesh" if mesh is not None else f"device ({device.device_kind})"


def _batch_size_row(model, drafter, requests: list[Prompt], repeats: int, engine: dict, spec_kw: dict,
                    schedules: tuple[str, ...]) -> dict:
    """Plain and speculative decoding of the requests at one batch size, under each schedule: an untimed pass that
    compiles and runs every shape, then `repeats` rounds of every side in alternating order (AB BA AB ...), so a
    machine slowing down hits all sides."""
    kw = {}
    for n, schedule in enumerate(schedules):
        suffix = "" if n == 0 else f"_{schedule}"
        kw["ar" + suffix] = dict(engine, schedule=schedule)
        if drafter is not None:
            kw["spec" + suffix] = dict(engine, schedule=schedule, drafter=drafter, **spec_kw)
    for side in kw:
        generate(model, requests, **kw[side])
    runs: dict[str, list] = {side: [] for side in kw}
    for i in range(repeats):
        for side in (list(kw) if i % 2 == 0 else list(kw)[::-1]):
            runs[side].append(generate(model, requests, **kw[side]))
    row: dict = {"batch_size": engine["batch_size"], "num_rows": len(requests)}
    if spec_kw.get("set_acceptance") is not None:
        row["set_acceptance"] = spec_kw["set_acceptance"]
    for side, results in runs.items():
        row[side] = _side(results)
    ratio = lambda a, b: statistics.median(y.stats["tokens_per_second"] / x.stats["tokens_per_second"]
                                           for x, y in zip(runs[a], runs[b]))
    if "spec" in runs:  # the median over the pairs of runs, each taken back to back under the same conditions
        row["speedup"] = ratio("ar", "spec")
        if "set_acceptance" not in row:  # set acceptance: the speculative text is meaningless
            row.update(_equivalence(runs["ar"][-1].token_ids, runs["spec"][-1].token_ids))
    for other in schedules[1:]:  # e.g. continuous over static, for each side
        row[f"{schedules[0]}_over_{other}"] = {side: ratio(f"{side}_{other}", side) for side in ("ar", "spec")
                                                 if side in runs}
        if "spec" in runs:
            row[f"speedup_{other}"] = ratio(f"ar_{other}", f"spec_{other}")
    return row


def _side(results) -> dict:
    """One side's figures: the last run's counts, the medians of its times, every run's tokens/s."""
    out = {k: results[-1].stats[k] for k in KEEP if k in results[-1].stats}
    for name in ("tokens_per_second", "requests_per_second", "run_seconds"):
        out[name] = statistics.median(r.stats[name] for r in results)
    out["tokens_per_second_runs"] = [r.stats["tokens_per_second"] for r in results]
    return out


def _equivalence(plain: list[list[int]], spec: list[list[int]]) -> dict:
    """The fraction of requests whose speculative tokens equal the plain ones, and where the others first differ
    (bfloat16 near-ties: a verify forward and a one-token step round differently)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
             for x, y in zip(plain, spec) if x != y]
    return {"output_equivalence": 1 - len(first) / len(plain), "first_divergence": sorted(first)}


def _log_row(row: dict) -> None:
    spec = row.get("spec", {})
    rate = f" at set acceptance {row['set_acceptance']}" if "set_acceptance" in row else ""
    same = f", {row['output_equivalence']:.0%} of rows equal to AR" if "output_equivalence" in row else ""
    speed = (f", speculative (k={spec['draft_len']}{rate}) {spec['tokens_per_second']:.1f} tok/s = "
             f"{row['speedup']:.2f}x AR, AL {spec.get('mean_accepted_length', 1.0):.2f}{same}") if spec else ""
    print(f"specformer bench: batch {row['batch_size']}: AR {row['ar']['tokens_per_second']:.1f} tok/s{speed}",
          file=sys.stderr)  # looked up at the call: a stream bound at import may be closed by now


SET_ACCEPTANCE_NOTE = ("speculative rows decoded with set acceptance: each draft accepted with the row's rate when "
                       "the ones before it were, not when the target agreed; every round paid the target's verify "
                       "forward and the drafter as usual. The tokens are meaningless; the times are what a drafter "
                       "of that acceptance would give.")


def synthetic_prompts(model: LoadedTarget, prompts: list[Prompt]) -> list[Prompt]:
    """The prompts, or for a model without a tokenizer (random weights) token ids in their place: for text prompt i,
    len(text) // 4 ids (about a tokenizer's rate for English) drawn uniformly from the vocabulary, seeded by i."""
    if model.tokenizer is not None:
        return prompts
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = np.random.default_rng(i).integers(0, model.cfg.vocab_size, max(1, len(p) // 4)).tolist()
        out.append(p)
    return out
