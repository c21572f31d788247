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

from specformer_jax.decoding import speculative
from specformer_jax.decoding.plan import DecodePlan
from specformer_jax.decoding.pool import Pool
from specformer_jax.decoding.sampling import is_eos
from specformer_jax.decoding.speculative import choose_drafts, round_keys
from specformer_jax.modeling.drafter import DRAFT_VOCAB, draft_head_params
from specformer_jax.modeling.target import Target


def decode_round(plan: DecodePlan, params, dparams, head, s: Pool) -> Pool:
    """Every live row emits its accepted drafts and the target's next token (cut after an EOS and at its budget);
    head: draft_head_params of the target (speculative plans)."""
    live = ~s.done
    P, N, k = s.out.shape[0], s.out.shape[1], plan.draft_len
    keys = round_keys(s.keys, s.row_rounds + 1)
    tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # [P, k + 1]
    with jax.named_scope("verify" if k else "decode_step"):
        logits, cache, hidden = Target(plan.cfg, plan.hooks).apply({"params": params}, tokens, s.cache)
        if plan.set_acceptance:
            n, final = speculative.set_acceptance(logits, keys, k, s.accept_rate, plan.sampling)
        else:
            n, final = speculative.verify(logits, s.drafts, s.q, keys, plan.sampling)
    j = jnp.arange(k + 1)[None, :]
    emitted = jnp.where(j < n[:, None], jnp.pad(s.drafts, ((0, 0), (0, 1))), final[:, None])
    eos_at = jnp.min(jnp.where(is_eos(emitted, plan.eos_ids) & (j <= n[:, None]), j, k + 1), axis=1)
    count = jnp.where(live, jnp.minimum(jnp.minimum(n + 1, eos_at + 1), s.budget - s.num_out), 0)
    idx = jnp.where(j < count[:, None], s.num_out[:, None] + j, N)  # not emitted: dropped
    num_out = s.num_out + count
    keep = jnp.where(live, s.cache.lengths + n + 1, s.cache.lengths)  # x, d_1..d_n stay; the rest is past it
    s = s.replace(
        cache=cache.replace(lengths=keep), last=jnp.where(live, final, s.last),
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
        dlogits, dcache = plan.draft_fn()(dparams, head, hidden, s.dcache, jnp.zeros((P,), jnp.int32), n[:, None],
                                          emitted)
        drafts, q = choose_drafts(dlogits, keys[:, 2], plan.sampling, head.get(DRAFT_VOCAB), plan.cfg.vocab_size)
    return s.replace(dcache=dcache.replace(lengths=keep), drafts=jnp.where(live[:, None], drafts, s.drafts),
                     q=jnp.where(live[:, None, None], q, s.q))


def run_chunk(plan: DecodePlan, params, dparams, pool: Pool) -> Pool:
    """plan.chunk_rounds rounds on the pool."""
    head = draft_head_params(plan.cfg, params, dparams) if plan.speculative else None  # once per chunk, not per round
    return jax.lax.fori_loop(0, plan.chunk_rounds, lambda _, s: decode_round(plan, params, dparams, head, s), pool)
