"""Speculative decoding (greedy, and lossless sampling) with a SpecFormer drafter, entirely on the device in one
`lax.while_loop`.

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
from specformer_jax.decoding.sampling import SamplingConfig, process_logits, select_tokens, step_keys
from specformer_jax.modeling.drafter import (
    Drafter,
    draft_head_params,
    draft_logits,
    drafter_cache,
    next_token_embedding,
)
from specformer_jax.modeling.kv_cache import KVCache, target_cache
from specformer_jax.modeling.target import Target


@struct.dataclass
class SpecState:
    rounds: jax.Array  # int32[]: loop iterations
    cache: KVCache  # target; lengths = tokens whose KV is kept (x is not among them yet)
    dcache: KVCache  # drafter; same lengths
    last: jax.Array  # int32[B]: x, the last emitted token
    drafts: jax.Array  # int32[B, k]
    q: jax.Array  # float32[B, k, V]: the distribution each draft was sampled from ([B, k, 1] when greedy)
    out: jax.Array  # int32[B, N]
    num_out: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    row_rounds: jax.Array  # int32[B]: rounds in which the row was live
    row_emitted: jax.Array  # int32[B]: tokens emitted by those rounds (the prefill token excluded)
    accepted: jax.Array  # int32[B, k]: rounds in which slot i was accepted


# (drafter params, draft head params (draft_head_params), hidden {hook: [B, T, d]}, drafter cache, num_new [B],
#  slots_at [B, 1], next_tokens [B, 1]: the token emitted after that position, known when drafting)
#   -> (draft logits float32[B, k, V], drafter cache)
DraftFn = Callable


def specformer_drafts(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, num_slots: int) -> DraftFn:
    """The SpecFormer drafter as a draft function: logits of its first k slots at one position per row."""

    def draft(dparams, head_params, hidden, dcache, num_new, slots_at, next_tokens):
        next_embed = next_token_embedding(head_params, next_tokens) if drafter_cfg.next_token_input else None
        states, dcache = Drafter(target_cfg, drafter_cfg).apply(
            {"params": dparams}, hidden, dcache, num_new, slots_at, num_slots, next_embed
        )
        return draft_logits(target_cfg, head_params, states[:, 0]), dcache  # [B, k, V]

    return draft


def _leading(ok: jax.Array) -> jax.Array:
    """Length of the leading run of True per row: [B, k] -> int32[B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _choose_drafts(logits, keys, sampling: SamplingConfig):
    """Drafts from draft logits [B, k, V], and the distribution they were drawn from (what verification needs)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros(logits.shape[:2] + (1,), jnp.float32)
    processed = process_logits(logits, sampling)
    drafts = jax.vmap(lambda key, lg: jax.random.categorical(key, lg, axis=-1))(keys, processed)
    return drafts.astype(jnp.int32), jax.nn.softmax(processed, axis=-1)


def _verify(logits, drafts, q, keys, sampling: SamplingConfig):
    """(n, final): accepted leading drafts and the token emitted after them.

    Greedy: a draft is accepted iff it is the target's argmax; final is the argmax after the last accepted one.
    Sampling: draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); after a rejection the token is drawn
    from normalize(max(p - q, 0)) at that position, and after k acceptances from p (the bonus token). This keeps
    the output distribution exactly the target's.
    """
    B, k = drafts.shape
    if sampling.greedy:
        verified = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k + 1]
        n = _leading(drafts == verified[:, :k])
        return n, jnp.take_along_axis(verified, n[:, None], axis=1)[:, 0]
    k_accept, k_resample = keys[:, 0], keys[:, 1]
    p = jax.nn.softmax(process_logits(logits, sampling), axis=-1)  # [B, k + 1, V]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_accept)
    n = _leading(u * q_d < p_d)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 after the last slot: residual = p (bonus)
    residual = jnp.maximum(p_n - jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0], 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)  # p == q up to rounding
    final = jax.vmap(jax.random.categorical)(k_resample, jnp.log(residual))
    return n, final.astype(jnp.int32)


def spec_generate(
    params,
    dparams,
    prompts: jax.Array,  # int32[B, Tp], right-padded
    prompt_lens: jax.Array,  # int32[B]
    max_new: jax.Array,  # int32[B] (0 = inactive padding row)
    row_keys: jax.Array,  # PRNG key per row (unused when greedy)
    *,
    cfg: TargetConfig,
    hooks: tuple[int, ...],
    draft_fn: DraftFn,
    num_slots: int,
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    max_new_tokens: int,
) -> SpecState:
    """Speculative decoding of a ragged batch; tokens of row b are out[b, :num_out[b]]."""
    target = Target(cfg, hooks)
    B, Tp = prompts.shape
    N, k = max_new_tokens, num_slots
    S = Tp + N + k + 1
    cache = target_cache(cfg, B, S)
    head = draft_head_params(cfg, params)  # once per call, outside the loop

    def round_keys(step):  # per row: accept, resample, draft
        return jax.vmap(lambda key: jax.random.split(key, 3))(step_keys(row_keys, step))

    with jax.named_scope("prefill"):
        last = (prompt_lens - 1)[:, None]
        logits, cache, hidden = target.apply({"params": params}, prompts, cache, prompt_lens, last)
        keys0 = round_keys(0)
        first = select_tokens(logits[:, 0], keys0[:, 0], sampling)
        dlogits, dcache = draft_fn(dparams, head, hidden, drafter_cache(cfg, B, S), prompt_lens,
                                   (prompt_lens - 1)[:, None], first[:, None])
    drafts, q = _choose_drafts(dlogits, keys0[:, 2], sampling)
    active = max_new > 0
    zeros = jnp.zeros((B,), jnp.int32)
    state = SpecState(
        rounds=jnp.int32(0), cache=cache, dcache=dcache, last=first, drafts=drafts, q=q,
        out=jnp.zeros((B, N), jnp.int32).at[:, 0].set(jnp.where(active, first, 0)),
        num_out=active.astype(jnp.int32), done=~active | is_eos(first, eos_ids) | (max_new <= 1),
        row_rounds=zeros, row_emitted=zeros, accepted=jnp.zeros((B, k), jnp.int32),
    )

    def cond(s: SpecState):
        return ~jnp.all(s.done)

    def body(s: SpecState):
        live = ~s.done
        keys = round_keys(s.rounds + 1)
        tokens = jnp.concatenate([s.last[:, None], s.drafts], axis=1)  # [B, k + 1]
        with jax.named_scope("verify"):
            logits, cache, hidden = target.apply({"params": params}, tokens, s.cache)
            n, final = _verify(logits, s.drafts, s.q, keys, sampling)
        # emitted this round: d_1..d_n, then `final`; cut after an EOS and at the row's budget
        j = jnp.arange(k + 1)[None, :]
        emitted = jnp.where(j < n[:, None], jnp.pad(s.drafts, ((0, 0), (0, 1))), final[:, None])
        eos_at = jnp.min(jnp.where(is_eos(emitted, eos_ids) & (j <= n[:, None]), j, k + 1), axis=1)
        count = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), max_new - s.num_out)
        count = jnp.where(live, count, 0)
        idx = jnp.where(j < count[:, None], s.num_out[:, None] + j, N)  # not emitted: dropped
        out = s.out.at[jnp.arange(B)[:, None], idx].set(emitted, mode="drop")
        num_out = s.num_out + count
        done = s.done | (eos_at < count) | (num_out >= max_new)
        keep = jnp.where(live, s.cache.lengths + n + 1, s.cache.lengths)  # x, d_1..d_n stay; the rest is past it
        with jax.named_scope("draft"):
            dlogits, dcache = draft_fn(dparams, head, hidden, s.dcache, jnp.zeros((B,), jnp.int32), n[:, None],
                                      final[:, None])
            drafts, q = _choose_drafts(dlogits, keys[:, 2], sampling)
        return SpecState(
            rounds=s.rounds + 1,
            cache=cache.replace(lengths=keep),
            dcache=dcache.replace(lengths=keep),
            last=jnp.where(live, final, s.last),
            drafts=jnp.where(live[:, None], drafts, s.drafts),
            q=jnp.where(live[:, None, None], q, s.q),
            out=out,
            num_out=num_out,
            done=done,
            row_rounds=s.row_rounds + live,
            row_emitted=s.row_emitted + count,
            accepted=s.accepted + (live[:, None] & (jnp.arange(k)[None, :] < n[:, None])),
        )

    return jax.lax.while_loop(cond, body, state)
