"""Greedy speculative decoding with a SpecFormer drafter, entirely on the device in one `lax.while_loop`.

Each round feeds every row [x, d_1..d_k] (x: the last emitted token, not yet in the caches; d: drafts) through ONE
target forward that also returns the hooked hidden states, and the drafter's context layer over the same tokens.
Row b accepts the n_b leading drafts equal to the target's argmax, emits them plus the target's next token, and
keeps cache entries up to x, d_1..d_n by setting its length: rejected positions lie past it and are never read.
The next drafts come from the drafter's slots at the row's last accepted position of this same forward.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.autoregressive import is_eos
from specformer_jax.modeling.drafter import Drafter, draft_logits, drafter_cache
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.target import Target


@struct.dataclass
class SpecState:
    rounds: jax.Array  # int32[]: loop iterations
    cache: KVCache  # target; lengths = tokens whose KV is kept (x is not among them yet)
    dcache: KVCache  # drafter; same lengths
    last: jax.Array  # int32[B]: x, the last emitted token
    drafts: jax.Array  # int32[B, k]
    out: jax.Array  # int32[B, N]
    num_out: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    row_rounds: jax.Array  # int32[B]: rounds in which the row was live
    row_emitted: jax.Array  # int32[B]: tokens emitted by those rounds (the prefill token excluded)
    accepted: jax.Array  # int32[B, k]: rounds in which slot i was accepted


# (drafter params, target params, hidden {hook: [B, T, d]}, drafter cache, num_new [B], slots_at [B, 1])
#   -> (drafts int32[B, k], drafter cache)
DraftFn = Callable


def specformer_drafts(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, num_slots: int) -> DraftFn:
    """The SpecFormer drafter as a draft function: greedy drafts from its slots at one position per row."""

    def draft(dparams, tparams, hidden, dcache, num_new, slots_at):
        states, dcache = Drafter(target_cfg, drafter_cfg).apply(
            {"params": dparams}, hidden, dcache, num_new, slots_at, num_slots
        )
        logits = draft_logits(target_cfg, tparams, states[:, 0])  # [B, k, V]
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), dcache

    return draft


def spec_generate(
    params,
    dparams,
    prompts: jax.Array,  # int32[B, Tp], right-padded
    prompt_lens: jax.Array,  # int32[B]
    max_new: jax.Array,  # int32[B] (0 = inactive padding row)
    *,
    cfg: TargetConfig,
    hooks: tuple[int, ...],
    draft_fn: DraftFn,
    num_slots: int,
    eos_ids: tuple[int, ...],
    max_new_tokens: int,
):
    """Returns the final SpecState (tokens in .out[:, :num_out]) ."""
    target = Target(cfg, hooks)
    B, Tp = prompts.shape
    N, k = max_new_tokens, num_slots
    S = Tp + N + k + 1
    cache = KVCache.zeros(cfg.num_layers, B, S, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    with jax.named_scope("prefill"):
        logits, cache, hidden = target.apply({"params": params}, prompts, cache, prompt_lens, (prompt_lens - 1)[:, None])
        drafts, dcache = draft_fn(dparams, params, hidden, drafter_cache(cfg, B, S), prompt_lens,
                                  (prompt_lens - 1)[:, None])
    first = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    active = max_new > 0
    zeros = jnp.zeros((B,), jnp.int32)
    state = SpecState(
        rounds=jnp.int32(0), cache=cache, dcache=dcache, last=first, drafts=drafts,
        out=jnp.zeros((B, N), jnp.int32).at[:, 0].set(jnp.where(active, first, 0)),
        num_out=active.astype(jnp.int32), done=~active | is_eos(first, eos_ids) | (max_new <= 1),
        row_rounds=zeros, row_emitted=zeros, accepted=jnp.zeros((B, k), jnp.int32),
    )

    def cond(s: SpecState):
        return ~jnp.all(s.done)

    def body(s: SpecState):
        live = ~s.done
        tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # [B, k + 1]
        with jax.named_scope("verify"):
            logits, cache, hidden = target.apply({"params": params}, tokens, s.cache)
        verified = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k + 1]: target's token after each input
        match = (s.drafts == verified[:, :k]).astype(jnp.int32)
        n = jnp.sum(jnp.cumprod(match, axis=1), axis=1)  # leading accepted drafts, 0..k
        # emitted this round: d_1..d_n then the target's token after d_n (== verified[:, :n + 1])
        j = jnp.arange(k + 1)[None, :]
        budget = max_new - s.num_out
        eos_at = jnp.where(is_eos(verified, eos_ids) & (j <= n[:, None]), j, k + 1)
        count = jnp.minimum(jnp.minimum(n + 1, jnp.min(eos_at, axis=1) + 1), budget)
        count = jnp.where(live, count, 0)
        idx = jnp.where(j < count[:, None], s.num_out[:, None] + j, N)  # not emitted: dropped
        out = s.out.at[jnp.arange(B)[:, None], idx].set(verified, mode="drop")
        num_out = s.num_out + count
        hit_eos = jnp.min(eos_at, axis=1) < count
        done = s.done | hit_eos | (num_out >= max_new)
        keep = jnp.where(live, s.cache.lengths + n + 1, s.cache.lengths)  # x, d_1..d_n stay; the rest is past it
        with jax.named_scope("draft"):
            drafts, dcache = draft_fn(dparams, params, hidden, s.dcache, jnp.zeros((B,), jnp.int32), n[:, None])
        nxt = jnp.take_along_axis(verified, n[:, None], axis=1)[:, 0]
        return SpecState(
            rounds=s.rounds + 1,
            cache=cache.replace(lengths=keep),
            dcache=dcache.replace(lengths=keep),
            last=jnp.where(live, nxt, s.last),
            drafts=jnp.where(live[:, None], drafts, s.drafts),
            out=out,
            num_out=num_out,
            done=done,
            row_rounds=s.row_rounds + live,
            row_emitted=s.row_emitted + count,
            accepted=s.accepted + (live[:, None] & (jnp.arange(k)[None, :] < n[:, None])),
        )

    return jax.lax.while_loop(cond, body, state)
