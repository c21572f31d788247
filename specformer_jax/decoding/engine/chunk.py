"""One round of the engine on every row of the pool, and the chunk: R rounds with a static trip count.

A round is a plain step when the plan drafts nothing (k = 0: the target's forward over the last token) and a
speculative round otherwise (over [x, d_1..d_k], then the drafter); the bookkeeping is shared, and rows that are
done or empty change nothing. A chunk's trip count is static, so a GPU replays its body without copying a loop
predicate to the host each round (a data-dependent `while_loop` does that); the host looks at the pool only between
chunks. Rounds in which every row is done run too (a branch skipping them would carry the caches through it). On a
CPU, where the loop runs on the host anyway, a chunk instead stops after the round in which a row finished
(DecodePlan.stop_early), so its slot does not idle for the rest of the chunk (up to R - 1 rounds a request).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specformer_jax.decoding.acceptance.sampling import is_eos
from specformer_jax.decoding.acceptance.speculative import round_keys
from specformer_jax.decoding.engine.budget import (
    Sizes,
    best_size,
    budget_sizes,
    chosen_lengths,
    draft_values,
    flat_layout,
    gather_rows,
    verify_flat,
)
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.pool import Pool, first_rows, with_first_rows
from specformer_jax.modeling.target import Target


def decode_round(plan: DecodePlan, width: int, params, source, accept, s: Pool, drafting: bool = True,
                 budget: int | Sizes = 0) -> Pool:
    """Every live row emits its accepted drafts and the target's next token (cut after an EOS and at its budget),
    verifying each row's first `width` drafts (plan.draft_len but in a narrower chunk, `run_chunk`), or with a
    `budget` of positions, the most valuable of them that fit (engine/budget.py; at least the row's last token; sizes
    with their costs: the size this round's drafts make best, `best_size`).
    Without `drafting` (width 0: a plain step on a speculative pool, `run_plain_chunk`) the drafter does not run.
    source: the draft source of a speculative plan, bound to the target's parameters (draft_source.py), else None;
    accept: the acceptance rule (speculative.Verify, or a measurement's). The parts are functions of their own, which
    `specformer profile-round` times one by one (bench/round_profile.py)."""
    keys = round_keys(s.keys, s.row_rounds + 1)
    drafts, q = s.drafts[:, :width], s.q[:, :width]
    with jax.named_scope("verify" if plan.speculative else "decode_step"):
        if budget:
            n, final, cache, hidden, chosen = flat_verify(plan, params, source, accept, s, drafts, q, keys,
                                                          budget_sizes(budget))
        else:
            tokens = jnp.concatenate([s.last[:, None], drafts], axis=1)  # [P, width + 1]
            h, cache, hidden = target_pass(plan, params, source, tokens, s.cache)
            n, final = accept(target_logits(plan, params, h), drafts, q, keys, plan.sampling)
            chosen = None
    s, kept, emitted = update(plan, s, cache, drafts, n, final, chosen)
    if not plan.speculative:
        return s
    if not drafting:  # the drafts stay as they are; the source's state keeps pace with the cache
        return s.replace(draft_state=source.advance(plan, s.draft_state, kept, emitted))
    with jax.named_scope("draft"):
        return next_drafts(plan, source, s, hidden, kept, n, emitted, keys)


def flat_verify(plan: DecodePlan, params, source, accept, s: Pool, drafts, q, keys, sizes: Sizes):
    """The verify pass over a budget of positions (engine/budget.py): every live row's last token and the most
    valuable drafts, as one flat list through the target (`Target.forward_flat`); with several sizes, at the one
    `best_size` picks for this round's drafts. Returns (n, final, the cache with the positions written, the hooked
    states in the padded layout [P, w + 1, d], drafts verified per row)."""
    live = ~s.done
    values = draft_values(source.confidence(plan, drafts, q, s.draft_state), live)
    passes = [lambda b=b: _flat_pass(plan, params, source, accept, s, drafts, q, keys, live, values, b)
              for b, _ in sizes]
    return passes[0]() if len(passes) == 1 else jax.lax.switch(best_size(values, live, sizes), passes)


def _flat_pass(plan: DecodePlan, params, source, accept, s: Pool, drafts, q, keys, live, values, budget: int):
    """`flat_verify` at one budget, given the live rows and the drafts' values."""
    chosen = chosen_lengths(values, live, budget)
    index, rows, at, valid = flat_layout(live, chosen, drafts.shape[1], budget)
    tokens = jnp.concatenate([s.last[:, None], drafts], axis=1)[rows, at]
    positions = jnp.where(valid, s.cache.lengths[rows] + at, s.cache.max_len)
    h, cache, hidden = Target(plan.cfg, source.hooks(plan)).apply({"params": params}, tokens, rows, positions,
                                                                   s.cache, method=Target.forward_flat)
    n, final = verify_flat(accept, target_logits(plan, params, h), index, drafts, q, keys, plan.sampling, chosen)
    return n, final, cache, {i: gather_rows(x, index) for i, x in hidden.items()}, chosen


def origin_widths(plan: DecodePlan, source) -> tuple[int, ...]:
    """Per origin of drafts, how many drafts a round verifies for its rows (draft_source.py, `widths`)."""
    return source.widths(plan) if plan.speculative else (0,)


def chunk_widths(plan: DecodePlan, source) -> tuple[int, ...]:
    """The widths a chunk may verify at: per origin of drafts on a CPU, where a chunk can end when its rows need
    another (`run_chunk`); elsewhere the widest, every round."""
    widths = origin_widths(plan, source)
    return tuple(sorted(set(widths))) if plan.stop_early else (max(widths),)


def needed_width(plan: DecodePlan, source, done, origin) -> jax.Array:
    """The widest of the live rows' needs (their drafts' origins' widths; done, origin: the pool's): the width the
    next round should verify at (int32[]; the narrowest when no row is live). The chunk and the host both ask it."""
    widths = origin_widths(plan, source)
    return jnp.max(jnp.where(done, min(widths), jnp.asarray(widths, jnp.int32)[origin]))


def target_pass(plan: DecodePlan, params, source, tokens: jax.Array, cache):
    """The target's forward over every row's tokens [x, d_1..d_k] (x alone when plain), without the LM head:
    (final-normed states [P, k + 1, d], the cache with them written, the hidden states the draft source reads)."""
    hooks = source.hooks(plan) if plan.speculative else ()
    return Target(plan.cfg, hooks).apply({"params": params}, tokens, cache, method=Target.forward)


def target_logits(plan: DecodePlan, params, h: jax.Array) -> jax.Array:
    """The LM head over every position of the round: float32 [P, k + 1, V]."""
    return Target(plan.cfg).apply({"params": params}, h, method=Target.logits)


def update(plan: DecodePlan, s: Pool, cache, drafts: jax.Array, n: jax.Array, final: jax.Array,
           chosen: jax.Array | None = None):
    """The bookkeeping of a round that verified the first chosen[b] of `drafts` [P, w] (w <= k; default all w) with
    n accepted and the token `final` after them per row: the tokens emitted (cut after an EOS and at the budget), the
    cache lengths, counts and flags.
    Returns (pool, kept: positions each row keeps in the caches (0: not live), emitted [P, w + 1]: the token after
    each position of [x, d_1..d_w])."""
    live = ~s.done
    P, N, k, w = s.out.shape[0], s.out.shape[1], plan.draft_len, drafts.shape[1]
    chosen = jnp.full((P,), w, jnp.int32) if chosen is None else chosen
    j = jnp.arange(w + 1)[None, :]
    emitted = jnp.where(j < n[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), final[:, None])
    eos_at = jnp.min(jnp.where(is_eos(emitted, plan.eos_ids) & (j <= n[:, None]), j, w + 1), axis=1)
    count = jnp.where(live, jnp.minimum(jnp.minimum(n + 1, eos_at + 1), s.budget - s.num_out), 0)
    idx = jnp.where(j < count[:, None], s.num_out[:, None] + j, N)  # not emitted: dropped
    num_out = s.num_out + count
    kept = jnp.where(live, n + 1, 0)  # x, d_1..d_n stay in the caches; the rest lies past their lengths
    by = live[:, None] & (jnp.arange(s.origin_rounds.shape[1])[None, :] == s.origin[:, None])  # [P, O]
    slot_ok = jnp.arange(k)[None, :] < n[:, None]
    s = s.replace(
        cache=cache.replace(lengths=s.cache.lengths + kept), last=jnp.where(live, final, s.last),
        out=s.out.at[jnp.arange(P)[:, None], idx].set(emitted, mode="drop"), num_out=num_out,
        done=s.done | (eos_at < count) | (num_out >= s.budget),
        row_rounds=s.row_rounds + live, row_emitted=s.row_emitted + count,
        accepted=s.accepted + (live[:, None] & slot_ok),
        origin_rounds=s.origin_rounds + by, origin_emitted=s.origin_emitted + by * count[:, None],
        origin_accepted=s.origin_accepted + (by[:, :, None] & slot_ok[:, None, :]),
        rounds=s.rounds + jnp.any(live), verified=s.verified + jnp.where(live, chosen, 0),
        bare_rounds=s.bare_rounds + (live & (chosen == 0)),
    )
    return s, kept, emitted


def next_drafts(plan: DecodePlan, source, s: Pool, hidden, kept, n, emitted, keys) -> Pool:
    """The next round's k drafts of every live row, from the position of its last accepted token (the token after
    each position of [x, d_1..d_w] is what the row emitted there: exact up to position n)."""
    drafts, q, state = source.draft(plan, hidden, s.draft_state, kept, n[:, None], emitted, keys[:, 2])
    live = kept > 0
    origin = source.origin(state)
    return s.replace(draft_state=state, drafts=jnp.where(live[:, None], drafts, s.drafts),
                     q=jnp.where(live[:, None, None], q, s.q),
                     origin=s.origin if origin is None else jnp.where(live, origin, s.origin))


def run_chunk(plan: DecodePlan, rounds: int, width: int, params, source, accept, pool: Pool,
              budget: int | Sizes = 0) -> Pool:
    """`rounds` rounds on the pool (R, a static trip count), each verifying `width` drafts (one of `chunk_widths`),
    or with a `budget` of positions (at least the pool's rows), the most valuable of its rows' first `width` drafts
    (engine/budget.py); source: bound to `params` (draft_source.py). With plan.stop_early (on a CPU), up to R rounds:
    the chunk ends after the round in which a row finished, so the host collects it and refills its slot at once,
    and no round runs after the last row is done; without a budget it also ends when the rows' drafts need another
    width (`needed_width`: a hybrid's n-gram rows more drafts verified than its SpecFormer rows, an n-gram row with
    no match none), so each round costs what its rows need. The host then runs the chunk of that width (the first
    round runs at this one)."""
    sizes = budget_sizes(budget)
    if sizes and sizes[0][0] < pool.done.shape[0]:
        raise ValueError(f"a budget of {sizes[0][0]} positions cannot hold the last tokens of "
                         f"{pool.done.shape[0]} rows")
    step = lambda s: decode_round(plan, width, params, source, accept, s, budget=sizes)
    switches = plan.stop_early and len(chunk_widths(plan, source)) > 1 and not sizes
    same = (lambda s: needed_width(plan, source, s.done, s.origin) == width) if switches else (lambda s: True)
    return _rounds(plan, rounds, step, same, pool)


def run_plain_chunk(plan: DecodePlan, rounds: int, params, source, accept, pool: Pool) -> Pool:
    """`run_chunk` of plain steps on a speculative pool: no draft is verified and the drafter does not run, so a
    round costs what plain decoding's does (the server's pool when too many rows are live for drafts to pay). The
    rows' drafts stay; the source's state keeps pace with the cache (draft_source.py, `advance`)."""
    step = lambda s: decode_round(plan, 0, params, source, accept, s, drafting=False)
    return _rounds(plan, rounds, step, lambda s: True, pool)


def run_budget_chunk(plan: DecodePlan, rounds: int, width: int, budget: int | Sizes, params, source, accept,
                     pool: Pool) -> Pool:
    """`run_chunk` with a budget of positions (its static arguments first, as the engine compiles them)."""
    return run_chunk(plan, rounds, width, params, source, accept, pool, budget)


def run_first_rows(plan: DecodePlan, rounds: int, width: int, rows: int, budget: int | Sizes, params, source, accept,
                   pool: Pool) -> Pool:
    """`run_chunk` at `width` (`run_plain_chunk` for 0 on a speculative pool; with a `budget` of positions, or 0)
    over the pool's first `rows` rows only (pool.first_rows: the caches stay in place), so a round costs what those
    rows cost, not the whole pool's."""
    part = first_rows(pool, rows)
    if width == 0 and plan.speculative:
        part = run_plain_chunk(plan, rounds, params, source, accept, part)
    else:
        part = run_chunk(plan, rounds, width, params, source, accept, part, budget)
    return with_first_rows(pool, part)


def _rounds(plan: DecodePlan, rounds: int, step, same, pool: Pool) -> Pool:
    """`rounds` of `step`; with plan.stop_early, until a row finishes or `same(pool)` turns false (`run_chunk`)."""
    if not plan.stop_early:
        s = jax.lax.fori_loop(0, rounds, lambda _, s: step(s), pool)
        return s.replace(rounds_run=s.rounds_run + rounds)
    go_on = lambda c: (c[0] < rounds) & ~jnp.any(c[1].done & ~pool.done) & ((c[0] == 0) | same(c[1]))
    n, s = jax.lax.while_loop(go_on, lambda c: (c[0] + 1, step(c[1])), (jnp.int32(0), pool))
    return s.replace(rounds_run=s.rounds_run + n)
