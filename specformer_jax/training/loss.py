"""Drafter objective, chunked so that the K x vocab logits of a whole batch never exist at once (the LM head + loss of
one chunk at a time, recomputed in the backward pass). Per slot, either

  ce  cross-entropy against the target's own tokens (the paper's hard labels), or
  kl  KL(target || drafter) against the target's full next-token distribution at the slot's position: slot i at t
      learns the distribution the target gives at t + 1 + i, i.e. for token t + 2 + i (logit distillation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.calibration import BINS, confidence_bins
from specformer_jax.modeling.drafter import (
    DrafterParams,
    apply_drafter,
    drafter_cache,
    next_token_embedding,
    vocab_head,
)
from specformer_jax.modeling.kv_cache import target_cache
from specformer_jax.modeling.target import Target


def slot_targets(tokens: jax.Array, label_mask: jax.Array, num_slots: int):
    """labels[b, t, i] = tokens[b, t + 2 + i] and weight = label_mask there (0 past the end). [B, T, K] each."""
    tokens, label_mask = jnp.asarray(tokens), jnp.asarray(label_mask)
    B, T = tokens.shape
    idx = jnp.arange(T)[:, None] + 2 + jnp.arange(num_slots)[None, :]  # [T, K]
    inside = idx < T
    idx = jnp.minimum(idx, T - 1)
    labels = tokens[:, idx]
    weights = jnp.where(inside[None], label_mask[:, idx], 0).astype(jnp.float32)
    return labels, weights


def following_tokens(tokens: jax.Array) -> jax.Array:
    """[B, T]: the token after each position (what a drafter with a next-token input sees there; 0 after the last
    position, whose slots are never supervised and whose context entry no later position of the batch reads)."""
    return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))


def target_hidden(target_cfg: TargetConfig, target_params, tokens, hooks):
    """Frozen target forward over whole sequences, returning only the hooked states (no vocab logits)."""
    B, T = tokens.shape
    cache = target_cache(target_cfg, B, T)
    _, _, hidden = Target(target_cfg, hooks).apply(
        {"params": target_params}, tokens, cache, logits_at=jnp.zeros((B, 1), jnp.int32)
    )
    return jax.lax.stop_gradient(hidden)


def slot_teacher_index(T: int, num_slots: int) -> jax.Array:
    """int32[T, K]: the position whose target distribution slot i at t learns under `kl` (t + 1 + i, clipped)."""
    return jnp.minimum(jnp.arange(T)[:, None] + 1 + jnp.arange(num_slots)[None, :], T - 1)


def slot_states(target_cfg, drafter_cfg, drafter_params: DrafterParams, hidden, B, T, next_embed=None,
                draft_len=None):
    return apply_drafter(target_cfg, drafter_cfg, drafter_params, hidden, drafter_cache(target_cfg, B, T),
                         draft_len=draft_len, next_embed=next_embed)[0]


def chunked_slot_ce(target_cfg, target_params, states, labels, weights, chunk_positions: int = 256, teacher=None,
                    per_position: bool = False, vocab=None, reach: bool = False, calibration: bool = False):
    """Sums over slots of the weighted loss, correct top-1 and the leading-accepted count, per slot.

    states [B, T, K, d], labels/weights [B, T, K]. `teacher` [B, T, K, d]: the target's final-normed states whose
    distributions the slots learn (KL); None: CE against `labels`. Returns dict of float32 arrays: ce_sum [K] (the
    loss: CE or KL), correct [K], count [K], and accepted_sum / positions (leading correct slots per position, over
    positions whose K slots are all supervised), accepted_at_least [K] (of those positions, how many have at least
    i + 1 leading correct slots). per_position: also "lead" int32[B, T], the leading correct slots at every position.

    vocab: int32[V'], a reduced draft vocabulary: the slots' logits span only it, and a label outside it is a miss
    that adds zero to the loss (CE) while still counting in `count`, the loss's denominator. Under KL the slots
    learn the target's probabilities of those V' tokens: sum over V' of p (log p - log q), which the mass outside V'
    can make negative.

    reach: also "reached_ce_sum" [K], each position's slot loss weighted by the chance that the slots before it are
    accepted (`reach_weights`).

    calibration: also the confidence bins [K, BINS] of modeling/calibration.py (`_calibration_sums`).
    """
    B, T, K, d = states.shape
    N = B * T
    pad = -N % chunk_positions
    # Supervised positions first (stable), so chunks with no supervised position (prompts, padding) can be skipped.
    order = jnp.argsort(~jnp.any(weights.reshape(N, K) > 0, axis=-1), stable=True)
    flat = lambda x: jnp.pad(x.reshape(N, *x.shape[2:])[order], [(0, pad)] + [(0, 0)] * (x.ndim - 2))
    chunks = N // chunk_positions + (pad > 0)
    xs = (flat(states).reshape(chunks, chunk_positions, K, d), flat(labels).reshape(chunks, chunk_positions, K),
          flat(weights).reshape(chunks, chunk_positions, K))
    if teacher is not None:
        xs += (flat(jax.lax.stop_gradient(teacher)).reshape(chunks, chunk_positions, K, d),)

    @jax.checkpoint
    def one(carry, x):
        sums, lead = jax.lax.cond(jnp.any(x[2] > 0), chunk_sums, lambda _: (zero, no_lead), x)
        return jax.tree.map(jnp.add, carry, sums), lead if per_position else None

    head_cfg, head_params, vocab, index = _draft_head(target_cfg, target_params, vocab)

    def chunk_sums(x):
        m, lab, w = x[:3]
        logits = Target(head_cfg).apply({"params": head_params}, m, method=Target.head)  # [C, K, V'] float32
        teacher_logits = None if teacher is None else Target(target_cfg).apply(
            {"params": target_params}, x[3], method=Target.logits)  # teacher states are final-normed
        ce, drafted = _slot_loss(logits, lab, teacher_logits, vocab, index)
        hit = (drafted == lab) & (w > 0)
        supervised = w > 0
        # accepted = leading run of correct slots, counted where the whole window is supervised
        lead = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=-1), axis=-1)
        full = jnp.all(supervised, axis=-1)
        extra = {"reached_ce_sum": jnp.sum(w * reach_weights(logits, lab, index) * ce, axis=0)} if reach else {}
        if calibration:  # slot i is reached where the window is supervised and the i slots before it were correct
            extra |= _calibration_sums(logits, hit, full[:, None] & (lead[:, None] >= jnp.arange(K)))
        return extra | {
            "ce_sum": jnp.sum(w * ce, axis=0),
            "correct": jnp.sum(hit, axis=0).astype(jnp.float32),
            "count": jnp.sum(w, axis=0),
            "accepted_sum": jnp.sum(jnp.where(full, lead, 0)).astype(jnp.float32),
            "accepted_at_least": jnp.sum(full[:, None] & (lead[:, None] > jnp.arange(K)), axis=0).astype(jnp.float32),
            "positions": jnp.sum(full).astype(jnp.float32),
        }, lead

    zero = _zero_sums(K, reach, calibration)
    no_lead = jnp.zeros((chunk_positions,), jnp.int32)
    sums, leads = jax.lax.scan(one, zero, xs)
    if per_position:
        sums["lead"] = jnp.zeros((N,), jnp.int32).at[order].set(leads.reshape(-1)[:N]).reshape(B, T)
    return sums


def _draft_head(target_cfg, target_params, vocab):
    """(the head's config and parameters over the draft vocabulary, gathered once outside the chunks; the vocabulary;
    its token -> logit map, -1 outside it), or the full head and None, None without a draft vocabulary."""
    vocab = None if vocab is None else jnp.asarray(vocab)
    head_cfg, head_params = vocab_head(target_cfg, target_params, vocab)
    index = None if vocab is None else jnp.full((target_cfg.vocab_size,), -1, jnp.int32).at[vocab].set(
        jnp.arange(vocab.shape[0], dtype=jnp.int32))
    return head_cfg, head_params, vocab, index


def _zero_sums(K: int, reach: bool, calibration: bool) -> dict:
    """`chunked_slot_ce`'s sums before any chunk is added."""
    zero = {"ce_sum": jnp.zeros(K), "correct": jnp.zeros(K), "count": jnp.zeros(K), "accepted_sum": jnp.zeros(()),
            "accepted_at_least": jnp.zeros(K), "positions": jnp.zeros(())}
    if reach:
        zero["reached_ce_sum"] = jnp.zeros(K)
    if calibration:
        zero |= {name: jnp.zeros((K, BINS)) for name in ("calib_count", "calib_accepted", "calib_confidence")}
    return zero


def _calibration_sums(logits, hit, reached) -> dict:
    """`chunked_slot_ce`'s calibration sums [K, BINS] from the slots' logits [C, K, V'], which slots were correct and
    which were reached (their window supervised, every earlier slot correct), both [C, K]: per slot and bin of the
    drafter's top probability, how many positions reached it ("calib_count"), how many of them were correct too
    ("calib_accepted") and their confidences' sum ("calib_confidence")."""
    confidence = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))  # the top probability
    at = jax.nn.one_hot(confidence_bins(confidence), BINS) * reached[..., None]  # [C, K, BINS]
    return {"calib_count": jnp.sum(at, axis=0), "calib_accepted": jnp.sum(at * hit[..., None], axis=0),
            "calib_confidence": jnp.sum(at * confidence[..., None], axis=0)}


def _slot_loss(logits, labels, teacher_logits, vocab, index):
    """(loss [C, K], the drafted token [C, K]) from the slots' logits over the draft vocabulary [C, K, V']: CE
    against `labels`, or KL from the teacher's distribution when teacher_logits [C, K, V] are given. vocab/index:
    the draft vocabulary's ids and token -> logit map (-1 outside), or None."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    if teacher_logits is None:
        at = labels if vocab is None else jnp.maximum(index[labels], 0)
        ce = lse - jnp.take_along_axis(logits, at[..., None], axis=-1)[..., 0]
        ce = ce if vocab is None else jnp.where(index[labels] >= 0, ce, 0.0)
    else:
        logp = jax.nn.log_softmax(teacher_logits, axis=-1)
        logp = logp if vocab is None else logp[..., vocab]
        ce = jnp.sum(jnp.exp(logp) * (logp - (logits - lse[..., None])), axis=-1)
    best = jnp.argmax(logits, axis=-1)
    return ce, best if vocab is None else vocab[best]


def reach_weights(logits, labels, index=None) -> jax.Array:
    """[C, K]: at each position, the product over the slots before slot i of the drafter's probability of that slot's
    label (the target's token): the chance that a draft sampled from the slots reaches slot i with every earlier draft
    accepted. Weighting slot i's loss by it aims the loss at the expected accepted length (a chain objective, as in
    arXiv 2606.11552) instead of every slot alike. A constant of the loss (no gradient through the weights). logits:
    the slots' [C, K, V'] over the draft vocabulary, whose token -> logit map is `index` (-1 outside: probability 0)."""
    logits = jax.lax.stop_gradient(logits)
    at = labels if index is None else jnp.maximum(index[labels], 0)
    logq = jnp.take_along_axis(logits, at[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)
    logq = logq if index is None else jnp.where(index[labels] >= 0, logq, -jnp.inf)
    before = jnp.cumsum(jnp.pad(logq[:, :-1], ((0, 0), (1, 0))), axis=-1)
    return jnp.exp(before)


def replay_rounds(lead: jax.Array, label_mask: jax.Array):
    """Greedy speculative decoding replayed on self-distilled answers: (tokens emitted by rounds, rounds), summed over
    rows. lead [B, T]: leading correct slots of the drafter at each position (chunked_slot_ce per_position).

    As in decoding, the target emits the first answer token, the drafter drafts from the last prompt position, and
    each round accepts lead[q] drafts plus the target's token, so the next round starts lead[q] + 1 positions on.
    Rounds thus skip the positions inside accepted runs, which an average over all positions counts as well: on
    text with easy and hard stretches that average overstates what decoding accepts.
    """
    B, T = lead.shape
    answer = jnp.sum(label_mask, axis=1).astype(jnp.int32)
    start = jnp.argmax(label_mask, axis=1).astype(jnp.int32)

    def body(c):
        q, emitted, rounds = c
        live = emitted < answer
        n = jnp.take_along_axis(lead, jnp.clip(q, 0, T - 1)[:, None], axis=1)[:, 0]
        step = jnp.minimum(n + 1, answer - emitted)
        return (jnp.where(live, q + n + 1, q), jnp.where(live, emitted + step, emitted), rounds + live)

    c0 = (start - 1, jnp.minimum(answer, 1), jnp.zeros((B,), jnp.int32))
    _, emitted, rounds = jax.lax.while_loop(lambda c: jnp.any(c[1] < answer), body, c0)
    return (jnp.sum(emitted - jnp.minimum(answer, 1)).astype(jnp.float32), jnp.sum(rounds).astype(jnp.float32))


OBJECTIVES = ("ce", "kl")


def hooks_read(target_cfg: TargetConfig, drafter_cfg: DrafterConfig, objective: str) -> tuple[int, ...]:
    """The target's hidden states the loss reads: the drafter's hooks, and under kl the final-normed output (whose
    distributions the slots learn) when they do not include it."""
    hooks, final = drafter_cfg.resolved_hooks(target_cfg), target_cfg.num_layers
    return hooks + ((final,) if objective == "kl" and final not in hooks else ())


def slot_weights(num_slots: int, decay: float) -> jax.Array:
    """Loss weight of each slot: exp(-decay * i) for slot i, normalised to sum 1 (decay 0: 1/K each). A decay puts
    the first slots, which every accepted run starts with, ahead (DFlash weighs its block positions so)."""
    w = jnp.exp(-decay * jnp.arange(num_slots, dtype=jnp.float32))
    return w / jnp.sum(w)


def drafter_loss(drafter_params: DrafterParams, target_params, tokens, label_mask, *, target_cfg: TargetConfig,
                 drafter_cfg: DrafterConfig, chunk_positions: int = 256, objective: str = "ce", replay: bool = False,
                 slot_decay: float = 0.0, draft_len: int | None = None, reach: bool = False, states=None):
    """The slots' token-mean losses (`objective`: ce or kl), weighted by `slot_weights` (default: the mean), over the
    drafter's draft vocabulary when it has one. Returns (loss, sums for metrics). replay: also the sums of
    `replay_rounds` and the calibration's (for evaluation: it is sequential). draft_len: score only the first k
    slots, as decoding with k drafts uses them (default: all K). reach: each position's slot loss weighted by
    `reach_weights` (the metrics' per-slot losses stay unweighted). states: [B, T, H, d], the target's states at the
    hooks `hooks_read` names, in its order (a state cache's), instead of running the target."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    B, T = tokens.shape
    hooks, read = drafter_cfg.resolved_hooks(target_cfg), hooks_read(target_cfg, drafter_cfg, objective)
    final = target_cfg.num_layers  # hook index of the final-normed output
    if states is None:
        hidden = target_hidden(target_cfg, target_params, tokens, read)
    else:  # cached (state_cache.py): the same states, rounded to bfloat16
        hidden = {i: jax.lax.stop_gradient(states[:, :, j].astype(target_cfg.dtype)) for j, i in enumerate(read)}
    next_embed = None
    if drafter_cfg.reads_next_tokens:
        next_embed = next_token_embedding(target_params, following_tokens(tokens))
    k = draft_len or drafter_cfg.num_slots
    slots = slot_states(target_cfg, drafter_cfg, drafter_params, {i: hidden[i] for i in hooks}, B, T, next_embed, k)
    labels, weights = slot_targets(tokens, label_mask, k)
    teacher = hidden[final][:, slot_teacher_index(T, k)] if objective == "kl" else None
    sums = chunked_slot_ce(target_cfg, target_params, slots, labels, weights, chunk_positions, teacher, replay,
                           drafter_params.vocab, reach, calibration=replay)
    if replay:
        sums["replay_emitted"], sums["replay_rounds"] = replay_rounds(sums.pop("lead"), label_mask)
    per_slot = (sums.pop("reached_ce_sum") if reach else sums["ce_sum"]) / jnp.maximum(sums["count"], 1.0)
    return jnp.sum(slot_weights(k, slot_decay) * per_slot), sums


def metrics_from_sums(sums) -> dict:
    """Per-slot loss, top-1 accuracy and acceptance, and the teacher-forced expected accepted length (bonus
    included)."""
    count = jnp.maximum(sums["count"], 1.0)
    return {
        "loss_per_slot": sums["ce_sum"] / count,
        "accuracy_per_slot": sums["correct"] / count,
        "expected_accepted_length": 1.0 + sums["accepted_sum"] / jnp.maximum(sums["positions"], 1.0),
        # teacher-forced counterpart of the decoding stat: fraction of rounds in which slot i would be accepted
        "acceptance_rate_per_slot": sums["accepted_at_least"] / jnp.maximum(sums["positions"], 1.0),
    } | ({"decoding_accepted_length": sums["replay_emitted"] / jnp.maximum(sums["replay_rounds"], 1.0)}
         if "replay_rounds" in sums else {})
