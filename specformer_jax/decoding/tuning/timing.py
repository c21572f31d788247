"""Timing the engine for `--draft-len auto` and `--verify-budget auto`: what a plain step, a round with k drafts and a
round with k drafts under a verify budget cost at a batch size and cache length on this device, measured on the
engine itself (greedy, compiled, the compilation left out)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp
from tqdm import tqdm

from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.set_acceptance import SetAcceptance
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine.plan import DecodePlan, make_plan
from specformer_jax.decoding.engine.runner import DecodeRun
from specformer_jax.decoding.engine.scheduler import decode_requests, run_to_end
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget

SHORT_BUDGET = 8  # tokens a row of the short run: its prefill and first rounds, taken off the long run's time
REPEATS = 3  # timings of each engine, taken in turn: one run's time on a busy CPU varies more than k's differ


def measure_costs(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
                  new_tokens: int = 64, repeats: int = REPEATS, progress: bool = False) -> dict:
    """{"step_seconds": t_step, "round_seconds": {k: t_round(k)}} for k = 1..K. `batch_size` rows decode `new_tokens`
    tokens from prompts of cache_len - new_tokens / 2 tokens, so the cache holds cache_len tokens on average. EOS is
    switched off so every row runs the whole budget; the time per round then includes everything a round does
    (verify, acceptance, drafting, bookkeeping). Every draft is rejected (set acceptance 0), so each k runs as many
    rounds as plain decoding; and a round's time is the difference between that run and a run of SHORT_BUDGET tokens
    over the difference in rounds, so the prefill, which would weigh more on a k that accepted more, drops out. The
    K + 1 engines are compiled concurrently first, then timed one after the other, `repeats` times in turn; each
    cost is the median of its repeats, so a slow moment of the machine moves no k alone."""
    runs = {k: (k, 0) for k in range(drafter.cfg.num_slots + 1)}
    median = _timed(runs, model, drafter, batch_size, cache_len, new_tokens, repeats,
                    progress and f"draft-len auto: timing decoding at batch {batch_size}")
    return {"step_seconds": median.pop(0), "round_seconds": median}


def measure_budget_costs(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int, k: int,
                         budgets: list[int], new_tokens: int = 64, repeats: int = REPEATS,
                         progress: bool = False) -> dict:
    """{"step_seconds": t_step, "budget_seconds": {B: t_round(B)}}: a plain step and a round with k drafts a row
    verifying B positions (engine/budget.py), for each B of `budgets`, measured as `measure_costs` measures."""
    runs = {0: (0, 0)} | {b: (k, b) for b in budgets}
    median = _timed(runs, model, drafter, batch_size, cache_len, new_tokens, repeats,
                    progress and f"verify-budget auto: timing rounds at batch {batch_size}")
    return {"step_seconds": median.pop(0), "budget_seconds": median}


def _timed(runs: dict, model, drafter, batch_size: int, cache_len: int, new_tokens: int, repeats: int,
           desc: str | bool) -> dict:
    """{name: the median seconds of a round} of each run {name: (draft length, verify budget)} (`measure_costs`);
    desc: the progress bar's, or False for none."""
    no_eos = dataclasses.replace(model, eos_ids=())
    prompt_len = max(1, cache_len - new_tokens // 2)
    prompts = [[(31 * i + 7 * r + 1) % model.cfg.vocab_size for i in range(prompt_len)] for r in range(batch_size)]
    plans = {name: (make_plan(no_eos, k, SamplingConfig(), new_tokens), b) for name, (k, b) in runs.items()}
    bar = tqdm(total=(1 + repeats) * len(plans), desc=desc or None, unit="step", file=sys.stderr,
               disable=not desc)  # compile each engine, then time it
    with bar:
        with concurrent.futures.ThreadPoolExecutor(len(plans)) as pool:  # XLA compiles outside the GIL
            list(pool.map(lambda pb: (_run(*pb, model, drafter, prompts, 2), bar.update()), plans.values()))
        times = {name: [] for name in plans}
        for _ in range(repeats):
            for name, (plan, b) in plans.items():
                short, full = (_run(plan, b, model, drafter, prompts, n) for n in (SHORT_BUDGET, None))
                times[name].append((full.run_seconds - short.run_seconds) / (full.rounds_run - short.rounds_run))
                bar.update()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _run(plan: DecodePlan, verify_budget: int, model, drafter, prompts, tokens: int | None = None) -> DecodeRun:
    """Every prompt in one static batch (with `tokens` new tokens each, else the plan's), every draft rejected."""
    keys = jax.random.split(jax.random.key(0), len(prompts))
    reject = SetAcceptance(jnp.float32(0.0))  # a round costs what it costs whatever is accepted
    source = SpecformerDrafts(drafter.cfg, drafter.params) if plan.speculative else None
    return run_to_end(decode_requests(plan, model.params, source, prompts, len(prompts), keys, schedule="static",
                                      accept=reject, budgets=None if tokens is None else [tokens] * len(prompts),
                                      verify_budget=verify_budget))
