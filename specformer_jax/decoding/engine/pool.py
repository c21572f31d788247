"""The decoding state of the engine: a pool of P rows (slots), each holding one request or nothing, and the jitted
refill that prefills a block of queued prompts into free slots.

Every row carries its own cache length, budget, PRNG key and round counter, so what a request decodes does not
depend on the slot it lands in, its neighbours, or when it was inserted. A row whose `done` is set changes nothing
when a round runs; an empty slot is a done row with budget 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.decoding.acceptance.sampling import is_eos, select_tokens
from specformer_jax.decoding.acceptance.speculative import round_keys
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.modeling.kv_cache import KVCache, target_cache
from specformer_jax.modeling.target import Target


@struct.dataclass
class Pool:
    cache: KVCache  # target, [L, P, Hkv, S, D]; lengths = tokens whose KV is kept (`last` is not among them yet)
    draft_state: Any  # the draft source's (draft_source.py), same lengths (None: plain decoding)
    last: jax.Array  # int32[P]: the last emitted token, the next round's first input
    drafts: jax.Array  # int32[P, k]: the next round's drafts (k = 0: plain decoding)
    q: jax.Array  # float32[P, k, V]: the distribution each draft was drawn from ([P, k, 1] when greedy)
    out: jax.Array  # int32[P, N]: the request's emitted tokens
    num_out: jax.Array  # int32[P]
    budget: jax.Array  # int32[P]: the request's max new tokens (0: an empty slot)
    done: jax.Array  # bool[P]: EOS emitted, budget reached, or empty
    keys: jax.Array  # PRNG key[P]: the request's own key
    row_rounds: jax.Array  # int32[P]: rounds the request was live in; round r draws from fold_in(key, r)
    row_emitted: jax.Array  # int32[P]: tokens those rounds emitted (the prefill's first token excluded)
    accepted: jax.Array  # int32[P, k]: rounds in which draft slot i was accepted
    origin: jax.Array  # int32[P]: which of the source's origins (draft_source.py) made the row's drafts
    origin_rounds: jax.Array  # int32[P, O]: the request's rounds by the origin of their drafts
    origin_emitted: jax.Array  # int32[P, O]: tokens those rounds emitted
    origin_accepted: jax.Array  # int32[P, O, k]: those rounds in which draft slot i was accepted
    verified: jax.Array  # int32[P]: drafts the request's rounds verified
    bare_rounds: jax.Array  # int32[P]: the request's rounds that verified no draft (a budget gave it none)
    rounds: jax.Array  # int32[]: rounds run with at least one live row
    rounds_run: jax.Array  # int32[]: rounds run, those after every row was done included


def cache_len(plan: DecodePlan, prompt_tokens: int) -> int:
    """Positions a row needs: its (bucketed) prompt, the answer, and one round's k + 1 tokens written past it."""
    return prompt_tokens + plan.max_new_tokens + plan.draft_len + 1


def empty_pool(plan: DecodePlan, pool_size: int, max_len: int, source) -> Pool:
    """A pool of `pool_size` empty slots whose caches hold `max_len` positions; source: the draft source of a
    speculative plan (its state has a row per slot), else None."""
    P, k, N = pool_size, plan.draft_len, plan.max_new_tokens
    zeros = jnp.zeros((P,), jnp.int32)
    width = 1 if plan.sampling.greedy else plan.cfg.vocab_size
    O = len(source.origins) if plan.speculative else 0
    return Pool(
        cache=target_cache(plan.cfg, P, max_len),
        draft_state=source.empty_state(plan, P, max_len) if plan.speculative else None,
        last=zeros, drafts=jnp.zeros((P, k), jnp.int32), q=jnp.zeros((P, k, width), jnp.float32),
        out=jnp.zeros((P, N), jnp.int32), num_out=zeros, budget=zeros, done=jnp.ones((P,), bool),
        keys=jax.random.split(jax.random.key(0), P), row_rounds=zeros, row_emitted=zeros,
        accepted=jnp.zeros((P, k), jnp.int32), origin=zeros, origin_rounds=jnp.zeros((P, O), jnp.int32),
        origin_emitted=jnp.zeros((P, O), jnp.int32), origin_accepted=jnp.zeros((P, O, k), jnp.int32),
        verified=zeros, bare_rounds=zeros, rounds=jnp.int32(0), rounds_run=jnp.int32(0),
    )


def insert(plan: DecodePlan, params, source, pool: Pool, prompts: jax.Array, lens: jax.Array, slots: jax.Array,
           budget: jax.Array, keys: jax.Array) -> Pool:
    """Prefill b prompts (int32[b, Tp], right-padded; lens int32[b]) and write them into pool rows `slots` (int32[b];
    an index past the pool drops that row: how a block is padded), with their budgets and PRNG keys. Each row emits
    its first token, and a speculative row gets its first drafts from the same forward (source: the draft source
    of a speculative plan, bound to `params`, else None)."""
    b, Tp = prompts.shape
    hooks = source.hooks(plan) if plan.speculative else ()
    with jax.named_scope("prefill"):
        logits, cache, hidden = Target(plan.cfg, hooks).apply(
            {"params": params}, prompts, target_cache(plan.cfg, b, Tp), lens, (lens - 1)[:, None])
    keys0 = round_keys(keys, jnp.zeros((b,), jnp.int32))
    first = select_tokens(logits[:, 0], keys0[:, 0], plan.sampling)
    put = lambda old, new: old.at[slots].set(new.astype(old.dtype), mode="drop")
    pool = pool.replace(cache=pool.cache.write_rows(cache, slots, lens, Tp))
    if plan.speculative:
        after = jnp.where(jnp.arange(Tp)[None, :] == (lens - 1)[:, None], first[:, None],
                          jnp.pad(prompts[:, 1:], ((0, 0), (0, 1))))  # the token after each prompt position
        drafts, q, state = source.draft(plan, hidden, source.empty_state(plan, b, Tp), lens, (lens - 1)[:, None],
                                        after, keys0[:, 2])
        origin = source.origin(state)
        pool = pool.replace(draft_state=pool.draft_state.write_rows(state, slots, lens, Tp),
                            drafts=put(pool.drafts, drafts), q=put(pool.q, q),
                            origin=pool.origin if origin is None else put(pool.origin, origin))
    zeros = jnp.zeros((b,), jnp.int32)
    return pool.replace(
        last=put(pool.last, first),
        out=put(pool.out, jnp.zeros((b, pool.out.shape[1]), jnp.int32).at[:, 0].set(first)),
        num_out=put(pool.num_out, jnp.ones((b,), jnp.int32)), budget=put(pool.budget, budget),
        done=put(pool.done, is_eos(first, plan.eos_ids) | (budget <= 1)),
        keys=pool.keys.at[slots].set(keys, mode="drop"),
        row_rounds=put(pool.row_rounds, zeros), row_emitted=put(pool.row_emitted, zeros),
        verified=put(pool.verified, zeros), bare_rounds=put(pool.bare_rounds, zeros),
        accepted=put(pool.accepted, jnp.zeros((b, plan.draft_len), jnp.int32)),
        origin_rounds=put(pool.origin_rounds, jnp.zeros((b,) + pool.origin_rounds.shape[1:], jnp.int32)),
        origin_emitted=put(pool.origin_emitted, jnp.zeros((b,) + pool.origin_emitted.shape[1:], jnp.int32)),
        origin_accepted=put(pool.origin_accepted, jnp.zeros((b,) + pool.origin_accepted.shape[1:], jnp.int32)),
    )


def cancel_rows(plan: DecodePlan, pool: Pool, slots: jax.Array) -> Pool:
    """Rows `slots` (int32[n]) marked done: their requests were abandoned, and from the next round on they change
    nothing, like an empty slot (the next insert into them overwrites every field)."""
    return pool.replace(done=pool.done.at[slots].set(True, mode="drop"))


def _rows_of(fn_cache, fn_other):
    """A function of a pool (and of pools like it, `more`) applying fn_cache to its KV caches (rows on axis 1 of k and
    v) and fn_other to every other array with a row axis (axis 0); the pool's counters (scalars) are the last pool's."""
    def node(x, *more):
        if isinstance(x, KVCache):
            return fn_cache(x, *more)
        return (more or (x,))[-1] if x.ndim == 0 else fn_other(x, *more)
    return lambda pool, *more: jax.tree.map(node, pool, *more, is_leaf=lambda x: isinstance(x, KVCache))


def first_rows(pool: Pool, n: int) -> Pool:
    """The pool's first n rows as a pool of n rows, but with the whole pool's KV caches: a forward over n rows reads
    and writes row b of a cache for its row b (pallas_kernels.ragged_attention), so the caches, the pool's bulk,
    are not copied out and back; only the rows' small state is. What the server runs when few slots are live."""
    return _rows_of(lambda c: KVCache(c.k, c.v, c.lengths[:n]), lambda x: x[:n])(pool)


def with_first_rows(pool: Pool, part: Pool) -> Pool:
    """`pool` with its first rows replaced by `part` (what `first_rows` gave, after decoding): part's caches are
    the whole pool's."""
    n = part.done.shape[0]
    put = lambda full, new: KVCache(new.k, new.v, full.lengths.at[:n].set(new.lengths))
    return _rows_of(put, lambda full, new: full.at[:n].set(new))(pool, part)


def move_rows(plan: DecodePlan, pool: Pool, src: jax.Array, dst: jax.Array) -> Pool:
    """Rows `src` (int32[m]) copied into rows `dst` (free slots, none of them in src), caches included, and rows
    `src` left empty: how the server keeps its live rows first, so that a chunk runs over as few rows as are live.
    An index past the pool in both (padding) moves nothing."""
    copy = lambda x: x.at[dst].set(x[src], mode="drop")
    kv = lambda a: a.at[:, dst].set(a[:, src], mode="drop")
    moved = _rows_of(lambda c: KVCache(kv(c.k), kv(c.v), copy(c.lengths)), copy)(pool)
    return moved.replace(done=moved.done.at[src].set(True, mode="drop"),
                         budget=moved.budget.at[src].set(0, mode="drop"))
