"""One round of the engine on every row of the pool, and the chunk: R rounds with a static trip count.

A round is a plain step when the plan drafts nothing (k = 0: the target's forward over the last token) and a
speculative round otherwise (over [x, d_1..d_k], then the drafter); the bookkeeping is shared, and rows that are
done or empty change nothing. A chunk's trip count is static, so a GPU replays its body without copying a loop
predicate to the host each round (a data-dependent `while_loop` does that); the host looks at the pool only between
chunks. Rounds in which every row is done run too (a branch skipping them would carry the caches through it).
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
    accept: the acceptance rule (speculative.Verify, or a measurement's)."""
    live = ~s.done
    P, N, k = s.out.shape[0], s.out.shape[1], plan.draft_len
    keys = round_keys(s.keys, s.row_rounds + 1)
    tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # [P, k + 1]
    with jax.named_scope("verify" if k else "decode_step"):
        hooks = source.hooks(plan) if k else ()
        logits, cache, hidden = Target(plan.cfg, hooks).apply({"params": params}, tokens, s.cache)
        n, final = accept(logits, s.drafts, s.q, keys, plan.sampling)
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
    if not k:
        return s
    with jax.named_scope("draft"):
        # the token after each position of [x, d_1..d_k] is what the row emitted there (exact up to position n)
        drafts, q, state = source.draft(plan, hidden, s.draft_state, kept, n[:, None], emitted, keys[:, 2])
    return s.replace(draft_state=state, drafts=jnp.where(live[:, None], drafts, s.drafts),
                     q=jnp.where(live[:, None, None], q, s.q))


def run_chunk(plan: DecodePlan, rounds: int, params, source, accept, pool: Pool) -> Pool:
    """`rounds` rounds on the pool (R, a static trip count)."""
    source = source.bind(plan, params) if plan.speculative else None  # once per chunk, not per round
    return jax.lax.fori_loop(0, rounds, lambda _, s: decode_round(plan, params, source, accept, s), pool)
