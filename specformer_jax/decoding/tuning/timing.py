"""Timing the engine for `--draft-len auto`: what a plain step and a round with k drafts cost at a batch size and
cache length on this device, measured on the engine itself (greedy, compiled, the compilation left out)."""

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
    no_eos = dataclasses.replace(model, eos_ids=())
    prompt_len = max(1, cache_len - new_tokens // 2)
    prompts = [[(31 * i + 7 * r + 1) % model.cfg.vocab_size for i in range(prompt_len)] for r in range(batch_size)]
    plans = [make_plan(no_eos, k, SamplingConfig(), new_tokens) for k in range(drafter.cfg.num_slots + 1)]
    bar = tqdm(total=(1 + repeats) * len(plans), desc=f"draft-len auto: timing decoding at batch {batch_size}",
               unit="step", file=sys.stderr, disable=not progress)  # compile each engine, then time it
    with bar:
        with concurrent.futures.ThreadPoolExecutor(len(plans)) as pool:  # XLA compiles outside the GIL
            list(pool.map(lambda plan: (_run(plan, model, drafter, prompts, budget=2), bar.update()), plans))
        times = {plan.draft_len: [] for plan in plans}
        for _ in range(repeats):
            for plan in plans:
                short, full = (_run(plan, model, drafter, prompts, budget) for budget in (SHORT_BUDGET, None))
                rounds = full.rounds_run - short.rounds_run
                times[plan.draft_len].append((full.run_seconds - short.run_seconds) / rounds)
                bar.update()
    median = {k: statistics.median(ts) for k, ts in times.items()}
    return {"step_seconds": median.pop(0), "round_seconds": median}


def _run(plan: DecodePlan, model, drafter, prompts, budget: int | None = None) -> DecodeRun:
    """Every prompt in one static batch (with a budget of `budget` tokens each, else the plan's), every draft
    rejected."""
    keys = jax.random.split(jax.random.key(0), len(prompts))
    reject = SetAcceptance(jnp.float32(0.0))  # a round costs what it costs whatever is accepted
    source = SpecformerDrafts(drafter.cfg, drafter.params) if plan.speculative else None
    return run_to_end(decode_requests(plan, model.params, source, prompts, len(prompts), keys, schedule="static",
                                      accept=reject, budgets=None if budget is None else [budget] * len(prompts)))
