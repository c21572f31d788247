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

from specformer_jax.decoding.plan import DecodePlan
from specformer_jax.decoding.pool import Pool
from specformer_jax.decoding.sampling import is_eos
from specformer_jax.decoding.speculative import round_keys
from specformer_jax.modeling.target import Target


def decode_round(plan: DecodePlan, params, source, accept, s: Pool) -> Pool:
    """Every live row emits its accepted drafts and the target's next token (cut after an EOS and at its budget).
    source: the draft source of a speculative plan, bound to the target's parameters (draft_source.py), else None;
    accept: the acceptance rule (speculative.Verify, or a measurement's). The parts are functions of their own, which
    `specformer profile-round` times one by one (bench/round_profile.py)."""
    keys = round_keys(s.keys, s.row_rounds + 1)
    with jax.named_scope("verify" if plan.speculative else "decode_step"):
        tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # [P, k + 1]
        h, cache, hidden = target_pass(plan, params, source, tokens, s.cache)
        n, final = accept(target_logits(plan, params, h), s.drafts, s.q, keys, plan.sampling)
    s, kept, emitted = update(plan, s, cache, n, final)
    if not plan.speculative:
        return s
    with jax.named_scope("draft"):
        return next_drafts(plan, source, s, hidden, kept, n, emitted, keys)


def target_pass(plan: DecodePlan, params, source, tokens: jax.Array, cache):
    """The target's forward over every row's tokens [x, d_1..d_k] (x alone when plain), without the LM head:
    (final-normed states [P, k + 1, d], the cache with them written, the hidden states the draft source reads)."""
    hooks = source.hooks(plan) if plan.speculative else ()
    return Target(plan.cfg, hooks).apply({"params": params}, tokens, cache, method=Target.forward)


def target_logits(plan: DecodePlan, params, h: jax.Array) -> jax.Array:
    """The LM head over every position of the round: float32 [P, k + 1, V]."""
    return Target(plan.cfg).apply({"params": params}, h, method=Target.logits)


def update(plan: DecodePlan, s: Pool, cache, n: jax.Array, final: jax.Array):
    """The bookkeeping of a round with n accepted drafts and the token `final` after them per row: the tokens emitted
    (cut after an EOS and at the budget), the cache lengths, counts and flags. Returns (pool, kept: positions each row
    keeps in the caches (0: not live), emitted [P, k + 1]: the token after each position of [x, d_1..d_k])."""
    live = ~s.done
    P, N, k = s.out.shape[0], s.out.shape[1], plan.draft_len
    j = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(j < n[:, None], jnp.pad(s.drafts, ((0, 0), (0, 1))), final[:, None])
    eos_at = jnp.min(jnp.where(is_eos(emitted, plan.eos_ids) & (j <= n[:, None]), j, k + 1), axis=1)
    count = jnp.where(live, jnp.minimum(jnp.minimum(n + 1, eos_at + 1), s.budget - s.num_out), 0)
    idx = jnp.where(j < count[:, None], s.num_out[:, None] + j, N)  # not emitted: dropped
    num_out = s.num_out + count
    kept = jnp.where(live, n + 1, 0)  # x, d_1..d_n stay in the caches; the rest lies past their lengths
    s = s.replace(
        cache=cache.replace(lengths=s.cache.lengths + kept), last=jnp.where(live, final, s.last),
        out=s.out.at[jnp.arange(P)[:, None], idx].set(emitted, mode="drop"), num_out=num_out,
        done=s.done | (eos_at < count) | (num_out >= s.budget),
        row_rounds=s.row_rounds + live, row_emitted=s.row_emitted + count,
        accepted=s.accepted + (live[:, None] & (jnp.arange(k)[None, :] < n[:, None])),
        rounds=s.rounds + jnp.any(live),
    )
    return s, kept, emitted


def next_drafts(plan: DecodePlan, source, s: Pool, hidden, kept, n, emitted, keys) -> Pool:
    """The next round's drafts of every live row, from the position of its last accepted token (the token after each
    position of [x, d_1..d_k] is what the row emitted there: exact up to position n)."""
    drafts, q, state = source.draft(plan, hidden, s.draft_state, kept, n[:, None], emitted, keys[:, 2])
    live = kept > 0
    return s.replace(draft_state=state, drafts=jnp.where(live[:, None], drafts, s.drafts),
                     q=jnp.where(live[:, None, None], q, s.q))


def run_chunk(plan: DecodePlan, rounds: int, params, source, accept, pool: Pool) -> Pool:
    """`rounds` rounds on the pool (R, a static trip count); source: bound to `params` (draft_source.py). With
    plan.stop_early (on a CPU), up to R rounds: the chunk ends after the round in which a row finished, so the host
    collects it and refills its slot at once, and no round runs after the last row is done."""
    step = lambda s: decode_round(plan, params, source, accept, s)
    if not plan.stop_early:
        s = jax.lax.fori_loop(0, rounds, lambda _, s: step(s), pool)
        return s.replace(rounds_run=s.rounds_run + rounds)
    go_on = lambda c: (c[0] < rounds) & ~jnp.any(c[1].done & ~pool.done)
    n, s = jax.lax.while_loop(go_on, lambda c: (c[0] + 1, step(c[1])), (jnp.int32(0), pool))
    return s.replace(rounds_run=s.rounds_run + n)
