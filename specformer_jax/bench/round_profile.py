"""`specformer profile-round`: what each part of a speculative round costs against the parts of a plain step, on the
engine's own functions (decoding/chunk.py), in one process.

For each batch size B and draft length k (k = 0: the plain step), a pool of B rows is prefilled with `context`
tokens each (random ids: costs do not depend on the text) and then timed:

  whole          the engine's chunk of R rounds, divided by R (what decoding pays a round, as `measure_costs`)
  target         the target's forward over [x, d_1..d_k] with the drafter's hooks, without the LM head
  lm_head        the LM head over the k + 1 positions
  accept         verification and acceptance (plain: choosing the next token)
  update         the round's bookkeeping: emitted tokens, cache lengths, counts
  draft_context  the drafter's context layer over the round's k + 1 positions
  draft_slots    its slot layer at the last accepted position
  draft_head     the final norm and LM head over the k slots (or the draft vocabulary), and the choice of drafts

Each part is compiled alone, as the engine compiles its functions, and its inputs are the values the parts before
it produced on the same pool. The rows' cache lengths are set back after every call, so each is timed at the same
context. The timed calls go round every item in turn, `repeats` times, and each item's figure is the median of its
calls: a machine that slows down for a while slows every item alike. The parts' sum is held against the whole.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from typing import Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu, resolve
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import Verify, round_keys
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine import runner
from specformer_jax.decoding.engine.budget import budget_sizes
from specformer_jax.decoding.engine.chunk import (
    flat_verify,
    run_budget_chunk,
    run_chunk,
    target_logits,
    target_pass,
    update,
)
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.engine.pool import cache_len, empty_pool, insert
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget

STEP_PARTS = ("target", "lm_head", "accept", "update")
ROUND_PARTS = STEP_PARTS + ("draft_context", "draft_slots", "draft_head")


def profile_rounds(model: LoadedTarget, drafter: LoadedDrafter, *, batch_sizes: list[int], draft_lens: list[int],
                   context: int = 72, chunk_rounds: int = 8, repeats: int = 20,
                   on_progress: Callable[[dict], None] | None = None, log: bool = True,
                   budgets: list[int] = ()) -> dict:
    """The profile document: per batch size the plain step and a round with each k of `draft_lens`, their parts and
    the ratios (rounds in plain steps, the parts' sum over the whole). `budgets`: positions past the batch size;
    each adds a round of the largest k with a budget of B + that many positions (engine/budget.py), timed whole
    and its flat verify pass alone ("budget_results"). `on_progress` gets the document after every batch size
    ("complete": false until the last)."""
    _check_positions(model, context, chunk_rounds, max(draft_lens))
    doc = {"context": context, "chunk_rounds": chunk_rounds, "repeats": repeats,
           "drafter_sha256": drafter.sha256, "draft_vocab_size": drafter.cfg.draft_vocab_size,
           "dtype": model.cfg.dtype, "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
           "cpu_count": os.cpu_count(),
           "cpu_kernels_target": cpu.build_target(),  # -march of the CPU kernels (pallas_kernels/cpu.py)
           "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
           "results": [], "budget_results": [], "complete": False}
    for B in batch_sizes:
        model.use_decoding_layout(B)
        layout = _layout(model)  # the target's decoding layout can differ by batch size (off the CPU kernels)
        timers = {k: _Timers(model, drafter, B, k, context, chunk_rounds) for k in [0, *draft_lens]}
        k_max = max(draft_lens)
        timers.update({("budget", B + e): _Timers(model, drafter, B, k_max, context, chunk_rounds, B + e)
                       for e in budgets})
        items = {(k, name): fn for k, t in timers.items() for name, fn in t.items.items()}
        seconds = _interleaved(items, {key: chunk_rounds for key in items if key[1] != "whole"}, repeats)
        seconds.update({(k, "whole"): seconds[k, "whole"] / chunk_rounds for k in timers})  # a chunk: R rounds
        step = seconds[0, "whole"]
        doc["budget_results"] += _budget_rows(B, k_max, [B + e for e in budgets], seconds, step, log)
        timers = {k: t for k, t in timers.items() if not isinstance(k, tuple)}
        for k, t in timers.items():
            parts = {name: seconds[k, name] for name in t.items if name != "whole"}
            whole = seconds[k, "whole"]
            row = {"batch_size": B, "draft_len": k, "layout": layout, "whole_seconds": whole, "parts_seconds": parts,
                   "parts_sum_seconds": sum(parts.values()), "parts_over_whole": sum(parts.values()) / whole,
                   "in_plain_steps": whole / step, "parts_in_plain_steps": {n: s / step for n, s in parts.items()}}
            doc["results"].append(row)
            if log:
                print(f"specformer profile-round: batch {B}, k = {k}: {whole * 1e3:.1f} ms a round, "
                      f"{whole / step:.2f} plain steps; parts sum to {row['parts_over_whole']:.2f}x", file=sys.stderr)
        doc["complete"] = B == batch_sizes[-1]
        del timers, items  # the pools and compiled parts of this batch size, before the next one's layout
        if on_progress:
            on_progress(doc)
    return doc


def _budget_rows(B: int, k: int, budgets: list[int], seconds: dict, step: float, log: bool) -> list[dict]:
    """The rows of the rounds with a budget at batch B (their timings in `seconds`, a plain step `step`)."""
    rows = []
    for budget in budgets:
        whole, flat = seconds[("budget", budget), "whole"], seconds[("budget", budget), "flat_target"]
        rows.append({"batch_size": B, "draft_len": k, "budget": budget, "whole_seconds": whole,
                     "in_plain_steps": whole / step, "flat_target_seconds": flat,
                     "flat_target_in_plain_steps": flat / step})
        if log:
            print(f"specformer profile-round: batch {B}, k = {k}, budget {budget}: {whole * 1e3:.1f} ms a round, "
                  f"{whole / step:.2f} plain steps (flat pass {flat * 1e3:.1f} ms)", file=sys.stderr)
    return rows


def _check_positions(model: LoadedTarget, context: int, chunk_rounds: int, k: int) -> None:
    """Refuse a context whose timed rounds run past the positions the model was trained on (a chunk of
    `chunk_rounds` rounds of k drafts writes up to chunk_rounds * (k + 1) tokens after it)."""
    reach, limit = context + chunk_rounds * (k + 1), model.cfg.max_position
    if reach > limit:
        raise SpecformerError(f"context {context} with a chunk of {chunk_rounds} rounds of up to {k} drafts reaches "
                              f"position {reach}, past the model's {limit}: give a context of at most "
                              f"{limit - chunk_rounds * (k + 1)}")


def _layout(model: LoadedTarget) -> dict:
    cfg = model.cfg
    return {"pack_weights": cfg.pack_weights, "fuse_projections": cfg.fuse_projections,
            "attention": resolve(cfg.attention, cfg.head_dim) or "reference"}


class _Timers:
    """The compiled whole and parts of one (batch size, k), on a pool prefilled to `context` tokens a row: `items`
    maps each name to a call that runs it once (setting back the lengths it moved)."""

    def __init__(self, model, drafter, B: int, k: int, context: int, R: int, budget: int = 0):
        no_eos = dataclasses.replace(model, eos_ids=())  # every row stays live however long it runs
        self.plan = make_plan(no_eos, k, SamplingConfig(), R * (k + 1) + 1)
        plan, self.params = self.plan, model.params
        # bound once, as the engine binds it once per call (scheduler.py)
        self.source = SpecformerDrafts(drafter.cfg, drafter.params).bind(plan, self.params) if k else None
        pool = _compiled(empty_pool, plan, (self.source,), static=(B, cache_len(plan, context)))(self.source)
        prompts = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (B, context)).astype(np.int32)
        args = (self.params, self.source, pool, jnp.asarray(prompts), jnp.full((B,), context, jnp.int32),
                jnp.arange(B, dtype=jnp.int32), jnp.full((B,), plan.max_new_tokens, jnp.int32),
                jax.random.split(jax.random.key(0), B))
        self.pool = _compiled(insert, plan, args, donate=(2,))(*args)
        self.start = jax.device_get({"lengths": self.pool.cache.lengths, "num_out": self.pool.num_out})
        self.items = {"whole": self._whole(R, budget)}
        if budget:
            self._flat_parts(budget)
        else:
            self._parts()

    def _rewind(self, pool):
        """The pool with its rows back at the start (same lengths and counts; the caches' contents kept)."""
        lengths = lambda: jnp.asarray(self.start["lengths"])  # an array each: the pool is donated leaf by leaf
        state = pool.draft_state.replace(lengths=lengths()) if pool.draft_state is not None else None
        return pool.replace(cache=pool.cache.replace(lengths=lengths()), draft_state=state,
                            num_out=jnp.asarray(self.start["num_out"]), done=jnp.zeros_like(pool.done))

    def _whole(self, R: int, budget: int):
        args = (self.params, self.source, Verify(), self.pool)
        static = (R, self.plan.draft_len) + ((budget,) if budget else ())
        chunk = _compiled(run_budget_chunk if budget else run_chunk, self.plan, args, static=static, donate=(3,))

        def call():
            self.pool = self._rewind(chunk(self.params, self.source, Verify(), self.pool))
            return self.pool
        return call

    def _parts(self):
        """Each part on the values the parts before it made (run once here to get them), each call on the same
        inputs. The target's forward updates its cache in place, as in the engine: it gets a copy of its own, fed
        back with the lengths set back after each call."""
        plan, params, source = self.plan, self.params, self.source
        s = jax.tree.map(jnp.copy, self._rewind(self.pool))  # the parts' own pool: the whole's is donated
        keys = round_keys(s.keys, s.row_rounds + 1)
        tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)
        forward = _compiled(target_pass, plan, (params, source, tokens, s.cache), donate=(3,))
        cache = {"now": jax.tree.map(jnp.copy, s.cache)}

        def target():
            h, new, hidden = forward(params, source, tokens, cache["now"])
            cache["now"] = new.replace(lengths=jnp.asarray(self.start["lengths"]))
            return h
        h, written, hidden = forward(params, source, tokens, jax.tree.map(jnp.copy, s.cache))
        head = _compiled(target_logits, plan, (params, h))
        accept_args = (Verify(), head(params, h), s.drafts, s.q, keys)
        accept = _compiled(_accept, plan, accept_args)
        n, final = accept(*accept_args)
        if plan.speculative:
            args = (s, written, s.drafts, n, final)
            self._draft_parts(*_compiled(update, plan, args)(*args), hidden, n, keys)
        # The bookkeeping reads the caches' lengths only, and the engine updates them in place; a call of its own
        # would copy every cache into its output, so it is timed on the pool with its caches' contents left out.
        update_args = (_without_contents(s), _without_contents(written), s.drafts, n, final)
        bookkeeping = _compiled(update, plan, update_args)
        self.items.update(target=target, lm_head=lambda: head(params, h), accept=lambda: accept(*accept_args),
                          update=lambda: bookkeeping(*update_args))

    def _flat_parts(self, budget: int):
        """The flat verify pass of a round with a budget (chunk.flat_verify: the choice, the target over the chosen
        positions, the LM head and acceptance), on a copy of the pool, its caches fed back as in `_parts`."""
        plan, params, source = self.plan, self.params, self.source
        s = jax.tree.map(jnp.copy, self._rewind(self.pool))
        keys = round_keys(s.keys, s.row_rounds + 1)
        flat = _compiled(_flat_pass, plan, (params, source, s.cache, s.replace(cache=None), keys), static=(budget,),
                         donate=(2,))
        state = {"cache": s.cache}

        def call():
            n, cache = flat(params, source, state["cache"], s.replace(cache=None), keys)
            state["cache"] = cache.replace(lengths=jnp.asarray(self.start["lengths"]))
            return n
        self.items["flat_target"] = call

    def _draft_parts(self, s, kept, emitted, hidden, n, keys):
        plan, source = self.plan, self.source
        context_args = (source, hidden, s.draft_state, kept, emitted)
        context = _compiled(_draft_context, plan, context_args)
        h, _, next_embed = context(*context_args)
        slots_args = (source, h, n[:, None], next_embed)
        slots = _compiled(_draft_slots, plan, slots_args)
        head_args = (source, slots(*slots_args), keys[:, 2])
        head = _compiled(_draft_head, plan, head_args)
        self.items.update(draft_context=lambda: context(*context_args), draft_slots=lambda: slots(*slots_args),
                          draft_head=lambda: head(*head_args))


def _without_contents(tree):
    """A pool or cache with every KV cache's keys and values replaced by one element (their lengths kept)."""
    shrink = lambda c: c.replace(k=jnp.zeros((1,), c.k.dtype), v=jnp.zeros((1,), c.v.dtype))
    if isinstance(tree, KVCache):
        return shrink(tree)
    state = None if tree.draft_state is None else shrink(tree.draft_state)
    return tree.replace(cache=shrink(tree.cache), draft_state=state)


def _flat_pass(plan, budget, params, source, cache, s, keys):
    n, _, cache, _, _ = flat_verify(plan, params, source, Verify(), s.replace(cache=cache), s.drafts, s.q, keys,
                                    budget_sizes(budget))
    return n, cache


def _accept(plan, accept, logits, drafts, q, keys):
    return accept(logits, drafts, q, keys, plan.sampling)


def _draft_context(plan, source, hidden, state, kept, emitted):
    return source.context(plan, hidden, state, kept, emitted)


def _draft_slots(plan, source, h, slots_at, next_embed):
    return source.slots(plan, h, slots_at, next_embed)


def _draft_head(plan, source, states, keys):
    return source.choose(plan, states, keys)


def _compiled(fn, plan, args, static=(), donate=()):
    return runner.COMPILED.get(fn, plan, args, static=static, donate=donate)[0]


def _interleaved(items: dict, calls: dict, repeats: int) -> dict:
    """Median seconds of each item's call: the timings go round every item in turn `repeats` times after one
    untimed round; a timing makes calls[key] calls back to back (default 1) and counts a share of their time each
    (a part runs as many times as the whole runs rounds, its calls queued one after the other as in a chunk)."""
    times = {key: [] for key in items}
    for i in range(repeats + 1):
        for key, call in items.items():
            n = calls.get(key, 1)
            t = time.perf_counter()
            for _ in range(n):
                out = call()
            jax.block_until_ready(out)
            if i:
                times[key].append((time.perf_counter() - t) / n)
    return {key: statistics.median(ts) for key, ts in times.items()}


PART_NAMES = {"target": "target forward (layers, hooks)", "lm_head": "LM head", "accept": "verify / accept",
              "update": "bookkeeping", "draft_context": "drafter: context layer", "draft_slots": "drafter: slot layer",
              "draft_head": "drafter: draft head + choice"}


def render_markdown(doc: dict) -> str:
    """A table per batch size: each part in ms and in plain steps, the parts' sum and the measured round."""
    out = []
    for B in sorted({r["batch_size"] for r in doc["results"]}):
        rows = sorted((r for r in doc["results"] if r["batch_size"] == B), key=lambda r: r["draft_len"])
        head = ["plain step" if r["draft_len"] == 0 else f"k = {r['draft_len']}" for r in rows]
        out += [f"Batch {B} (context {doc['context']} tokens; ms, and plain steps in brackets)", "",
                "| part | " + " | ".join(head) + " |", "|---|" + "---|" * len(rows)]
        cell = lambda r, s: f"{s * 1e3:.2f} ({s / (r['whole_seconds'] / r['in_plain_steps']):.2f})"
        for name in ROUND_PARTS:
            out.append(f"| {PART_NAMES[name]} | " + " | ".join(
                cell(r, r["parts_seconds"][name]) if name in r["parts_seconds"] else "" for r in rows) + " |")
        out.append("| **sum of parts** | " + " | ".join(cell(r, r["parts_sum_seconds"]) for r in rows) + " |")
        out.append("| **measured (chunk / R)** | " + " | ".join(cell(r, r["whole_seconds"]) for r in rows) + " |")
        out.append("| sum / measured | " + " | ".join(f"{r['parts_over_whole']:.2f}" for r in rows) + " |")
        out.append("")
        out += _budget_table(doc.get("budget_results", []), B)
    return "\n".join(out)


def _budget_table(results: list[dict], B: int) -> list[str]:
    """Rounds with a verify budget at batch B: the whole round and its flat verify pass, in ms and plain steps."""
    rows = [r for r in results if r["batch_size"] == B]
    if not rows:
        return []
    out = [f"Batch {B}, rounds with a verify budget (k = {rows[0]['draft_len']}; ms, and plain steps in brackets)", "",
           "| positions per round | round (chunk / R) | flat verify pass |", "|---|---|---|"]
    for r in rows:
        out.append(f"| {r['budget']} | {r['whole_seconds'] * 1e3:.2f} ({r['in_plain_steps']:.2f}) | "
                   f"{r['flat_target_seconds'] * 1e3:.2f} ({r['flat_target_in_plain_steps']:.2f}) |")
    return out + [""]
