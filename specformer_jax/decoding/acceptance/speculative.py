"""The math of a speculative round: choosing drafts from draft logits and verifying them against the target
(greedy, and lossless sampling), the acceptance rule a round is given by default (`Verify`). The round itself runs
in chunk.py, its drafts come from a draft source (draft_source.py).

Each round feeds every row [x, d_1..d_k] (x: the last emitted token, not yet in the caches; d: drafts) through ONE
target forward that also returns the hooked hidden states, and the drafter's context layer over the same tokens.
Row b accepts the n_b leading drafts the target agrees with, emits them plus the target's next token, and keeps
cache entries up to x, d_1..d_n by setting its length: rejected positions lie past it and are never read. The next
drafts come from the drafter's slots at the row's last accepted position of this same forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.decoding.acceptance.sampling import SamplingConfig, greedy_tokens, process_logits


def round_keys(keys: jax.Array, rounds: jax.Array) -> jax.Array:
    """Per row three PRNG keys (accept, resample, draft) for the row's round `rounds[b]` (0: the prefill), from the
    request's own key: what a request samples does not depend on its slot, neighbours or insertion time."""
    return jax.vmap(lambda key, r: jax.random.split(jax.random.fold_in(key, r), 3))(keys, rounds)


def leading(ok: jax.Array) -> jax.Array:
    """Length of the leading run of True per row: [B, k] -> int32[B]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def verified_slots(k: int, limit=None) -> jax.Array:
    """bool[B, k] (or [1, k]): the draft slots a round verifies, each row's first limit[b] (None: all k)."""
    return jnp.arange(k)[None, :] < (k if limit is None else limit[:, None])


def greedy_verdict(verified: jax.Array, drafts: jax.Array, limit=None):
    """(n, final) of greedy verification from the target's tokens [B, k + 1] at [x, d_1..d_k]: the leading drafts
    (of each row's first limit[b]) equal to them, and the target's token after the last one accepted."""
    n = leading((drafts == verified[:, :-1]) & verified_slots(drafts.shape[1], limit))
    return n, jnp.take_along_axis(verified, n[:, None], axis=1)[:, 0]


def choose_drafts(logits, keys, sampling: SamplingConfig, vocab=None, vocab_size: int = 0):
    """Drafts from draft logits [B, k, V'], and the distribution they were drawn from (what verification needs;
    greedy: [B, k, 1], the top probability).

    vocab: int32[V'], the token of each logit (a reduced draft vocabulary; None: logit i is token i); q then spans
    the whole vocabulary of `vocab_size` tokens, zero outside the draft vocabulary: the drafts never come from there.
    """
    if sampling.greedy:  # q: the top probability, the draft's confidence (`draft_confidence`)
        best = greedy_tokens(logits)
        top = 1.0 / jnp.sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), axis=-1)
        return best if vocab is None else vocab[best], top[..., None].astype(jnp.float32)
    processed = process_logits(logits, sampling)
    drafts = jax.vmap(lambda key, lg: jax.random.categorical(key, lg, axis=-1))(keys, processed).astype(jnp.int32)
    q = jax.nn.softmax(processed, axis=-1)
    if vocab is None:
        return drafts, q
    return vocab[drafts], jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., vocab].set(q)


def verify(logits, drafts, q, keys, sampling: SamplingConfig, limit=None):
    """(n, final): accepted leading drafts and the token emitted after them.

    Greedy: a draft is accepted iff it is the target's argmax; final is the argmax after the last accepted one.
    Sampling: draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); after a rejection the token is drawn
    from normalize(max(p - q, 0)) at that position, and after k acceptances from p (the bonus token). This keeps
    the output distribution exactly the target's. limit: int32[B], row b's drafts past its first limit[b] are not
    verified (a round with a budget, engine/budget.py): after limit[b] acceptances the bonus is drawn from p there.
    """
    B, k = drafts.shape
    if sampling.greedy:
        return greedy_verdict(greedy_tokens(logits), drafts, limit)
    k_accept, k_resample = keys[:, 0], keys[:, 1]
    p = jax.nn.softmax(process_logits(logits, sampling), axis=-1)  # [B, k + 1, V]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(k_accept)
    n = leading((u * q_d < p_d) & verified_slots(k, limit))
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # q = 0 after the last slot: residual = p (bonus)
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    q_n = q_n if limit is None else jnp.where((n < limit)[:, None], q_n, 0.0)  # every verified draft accepted: bonus
    residual = jnp.maximum(p_n - q_n, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)  # p == q up to rounding
    final = jax.vmap(jax.random.categorical)(k_resample, jnp.log(residual))
    return n, final.astype(jnp.int32)


def draft_confidence(q) -> jax.Array:
    """float32[B, k]: how likely each slot's draft is, from the drafter's distribution alone: its top probability
    (`choose_drafts`' q: greedy, that probability; sampling, the distribution drafts are drawn from). Never the
    probability of the draft drawn: a cut that depended on the draws would bias which drafts are verified, and
    sampled output would leave the target's distribution."""
    return jnp.max(q, axis=-1)


@struct.dataclass
class Verify:
    """The acceptance rule of decoding: the target verifies the drafts (`verify`). Rules are pytrees the round is
    given (measurement has its own, set_acceptance.py), so the round has no branch for them."""

    def __call__(self, logits, drafts, q, keys, sampling: SamplingConfig, limit=None):
        """(n, final): accepted leading drafts per row (at most limit[b]) and the token emitted after them."""
        return verify(logits, drafts, q, keys, sampling, limit)
