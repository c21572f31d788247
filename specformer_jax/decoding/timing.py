"""Timing the decoding loops for `--draft-len auto`: what a plain step and a round with k drafts cost at a batch
size and cache length on this device, measured on the real loops (greedy, compiled, the compilation left out)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import sys

import jax
import jax.numpy as jnp
from tqdm import tqdm

from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.decoding import runner
from specformer_jax.decoding.runner import DecodePlan, make_plan, pad_batch, run_batches
from specformer_jax.decoding.sampling import SamplingConfig


def measure_costs(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
                  new_tokens: int = 64, progress: bool = False) -> dict:
    """{"step_seconds": t_step, "round_seconds": {k: t_round(k)}} for k = 1..K. `batch_size` rows decode `new_tokens`
    tokens from prompts of cache_len - new_tokens / 2 tokens, so the cache holds cache_len tokens on average. EOS is
    switched off so every row runs the whole budget; the time per loop iteration then includes everything a round
    does (verify, acceptance, drafting, bookkeeping). The K + 1 loops are compiled concurrently first, then timed one
    after the other."""
    no_eos = dataclasses.replace(model, eos_ids=())
    prompt_len = max(1, cache_len - new_tokens // 2)
    prompts = [[(31 * i + 7 * r + 1) % model.cfg.vocab_size for i in range(prompt_len)] for r in range(batch_size)]
    plans = [make_plan(no_eos, drafter, k, SamplingConfig(), new_tokens) for k in range(drafter.cfg.num_slots + 1)]
    keys = jax.random.split(jax.random.key(0), batch_size)
    bar = tqdm(total=2 * len(plans), desc=f"draft-len auto: timing decode loops at batch {batch_size}",
               unit="step", file=sys.stderr, disable=not progress)  # compile each loop, then time it
    with bar:
        _compile_loops(plans, model.params, drafter.params, prompts, on_compiled=bar.update)
        times = {}
        for plan in plans:
            run = run_batches(plan, model.params, drafter.params, prompts, batch_size, keys)
            times[plan.draft_len] = run.run_seconds / max(run.steps, 1)
            bar.update()
    return {"step_seconds": times.pop(0), "round_seconds": times}


def _compile_loops(plans: list[DecodePlan], params, dparams, prompts: list[list[int]],
                   on_compiled=lambda: None) -> None:
    """Compile the loops of `plans` for one batch of these prompts, all at once in threads (XLA compiles outside the
    GIL, so the compilations overlap where there are cores to spare), then run each for one round, so its first
    launch costs are paid too and a run timed afterwards measures decoding alone."""
    prompt_arr, lens, budget = pad_batch(prompts, len(prompts), plans[0].max_new_tokens)
    keys = jax.random.split(jax.random.key(0), len(prompts))
    args = lambda plan, budget: ((params, dparams) if plan.speculative else (params,)) + (prompt_arr, lens, budget,
                                                                                            keys)

    def compile_one(plan):
        compiled = runner.COMPILED.get(plan, None, args(plan, budget))[0]
        on_compiled()
        return compiled

    with concurrent.futures.ThreadPoolExecutor(len(plans)) as pool:
        compiled = list(pool.map(compile_one, plans))
    for fn, plan in zip(compiled, plans):  # a budget of 2 tokens: the prefill and one round
        jax.block_until_ready(fn(*args(plan, jnp.minimum(budget, 2))))
