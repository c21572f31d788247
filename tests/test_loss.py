"""The chunked drafter loss equals a dense computation (values and gradients), however positions are chunked and
wherever the supervised positions lie (chunks without any are skipped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.config import TargetConfig
from specformer_jax.modeling.kv_cache import target_cache
from specformer_jax.modeling.target import Target, init_target
from specformer_jax.training.loss import chunked_slot_ce, replay_rounds, slot_targets, slot_teacher_index, target_hidden

TARGET = TargetConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8)


def dense_sums(target_params, states, labels, weights):
    logits = Target(TARGET).apply({"params": target_params}, states, method=Target.head)  # [B, T, K, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    K = labels.shape[-1]
    hit = (jnp.argmax(logits, -1) == labels) & (weights > 0)
    lead = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=-1), axis=-1)
    full = jnp.all(weights > 0, axis=-1)
    return {"ce_sum": jnp.sum(weights * ce, axis=(0, 1)), "correct": jnp.sum(hit, axis=(0, 1)).astype(jnp.float32),
            "count": jnp.sum(weights, axis=(0, 1)),
            "accepted_sum": jnp.sum(jnp.where(full, lead, 0)).astype(jnp.float32),
            "accepted_at_least": jnp.stack([jnp.sum(full & (lead > i)) for i in range(K)]).astype(jnp.float32),
            "positions": jnp.sum(full).astype(jnp.float32), "lead": lead}


@pytest.mark.parametrize("chunk", [7, 1000] + [pytest.param(c, marks=pytest.mark.slow) for c in (1, 64)])
def test_chunked_loss_and_gradient_equal_dense(chunk):
    B, T, K = 3, 20, 3
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    mask = np.zeros((B, T), np.int32)
    mask[0, 5:15] = 1  # answers in the middle, at the end, and a row with none
    mask[1, 12:] = 1
    labels, weights = slot_targets(tokens, jnp.asarray(mask), K)
    target_params = init_target(TARGET, jax.random.key(1))
    states = jax.random.normal(jax.random.key(2), (B, T, K, TARGET.hidden_size))
    argmax = jnp.argmax(Target(TARGET).apply({"params": target_params}, states, method=Target.head), -1)
    labels = jnp.where(jnp.asarray(rng.random((B, T, K)) < 0.6), argmax, labels)  # many right drafts, in runs

    chunked = lambda s, **kw: chunked_slot_ce(TARGET, target_params, s, labels, weights, chunk, **kw)
    got = jax.jit(lambda s: chunked(s, per_position=True))(states)
    want = jax.jit(dense_sums)(target_params, states, labels, weights)
    assert int(jnp.sum(want["lead"] > 1)) > 3  # the per-position check bites
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)

    loss = lambda fn: lambda s: jnp.sum(fn(s)["ce_sum"])
    g_chunked = jax.jit(jax.grad(loss(chunked)))(states)
    g_dense = jax.jit(jax.grad(loss(lambda s: dense_sums(target_params, s, labels, weights))))(states)
    np.testing.assert_allclose(g_chunked, g_dense, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_dense[2]).max()) == 0.0  # the unsupervised row gets no gradient


def reached_reference(logits, labels, weights, vocab=None) -> np.ndarray:
    """Plain Python: per slot, the sum over positions of its weight times its label's CE over the draft vocabulary
    (0 for a label outside it) times the product of the drafter's probabilities of the earlier slots' labels."""
    logits, labels, weights = (np.asarray(x, np.float64) for x in (logits, labels, weights))
    B, T, K, V = logits.shape
    ids = list(range(V)) if vocab is None else [int(v) for v in vocab]
    out = np.zeros(K)
    for b in range(B):
        for t in range(T):
            reach = 1.0
            for i in range(K):
                z = logits[b, t, i, ids]
                p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
                label = int(labels[b, t, i])
                prob = p[ids.index(label)] if label in ids else 0.0
                out[i] += weights[b, t, i] * reach * (-np.log(prob) if prob > 0 else 0.0)
                reach *= prob
    return out


@pytest.mark.parametrize("vocab", [None, "draft vocabulary"])
def test_reach_weighted_loss_equals_a_direct_computation(vocab):
    """slot_loss_reach: each slot's loss weighted by the drafter's probability of the earlier slots' labels, against
    a loop over positions and slots; no gradient flows through the weights; later slots weigh less than in the mean."""
    B, T, K = 2, 14, 3
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    mask = np.zeros((B, T), np.int32)
    mask[0, 3:] = mask[1, 8:12] = 1
    labels, weights = slot_targets(tokens, jnp.asarray(mask), K)
    target_params = init_target(TARGET, jax.random.key(1))
    states = jax.random.normal(jax.random.key(2), (B, T, K, TARGET.hidden_size))
    ids = None if vocab is None else jnp.asarray(np.sort(rng.choice(TARGET.vocab_size, 30, replace=False)), jnp.int32)
    sums = lambda s: chunked_slot_ce(TARGET, target_params, s, labels, weights, 7, vocab=ids, reach=True)
    got = jax.jit(sums)(states)
    logits = Target(TARGET).apply({"params": target_params}, states, method=Target.head)
    want = reached_reference(logits, labels, weights, None if ids is None else np.asarray(ids))
    np.testing.assert_allclose(got["reached_ce_sum"], want, rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(got["reached_ce_sum"])[1:] < np.asarray(got["ce_sum"])[1:])  # weights below 1 bite
    np.testing.assert_allclose(got["reached_ce_sum"][0], got["ce_sum"][0], rtol=1e-6)  # slot 0 is always reached

    # the gradient is the weighted CE's with the weights held fixed
    frozen = jax.lax.stop_gradient(reach_weights_dense(logits, labels, ids))
    def weighted(s):
        out = sums(s)
        return jnp.sum(out["reached_ce_sum"])
    def by_hand(s):
        lg = Target(TARGET).apply({"params": target_params}, s, method=Target.head)
        lg = lg if ids is None else lg[..., ids]
        at = labels if ids is None else jnp.maximum(jnp.searchsorted(ids, labels), 0)
        inside = jnp.ones(labels.shape, bool) if ids is None else ids[jnp.clip(at, 0, ids.shape[0] - 1)] == labels
        ce = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, at[..., None], -1)[..., 0]
        return jnp.sum(weights * frozen * jnp.where(inside, ce, 0.0))
    np.testing.assert_allclose(jax.jit(jax.grad(weighted))(states), jax.jit(jax.grad(by_hand))(states), rtol=1e-4,
                               atol=1e-6)


def reach_weights_dense(logits, labels, ids):
    """The reach weights [B, T, K] from full logits, by a cumulative product (the test's second route to them)."""
    lg = logits if ids is None else logits[..., ids]
    p = jax.nn.softmax(lg, -1)
    at = labels if ids is None else jnp.clip(jnp.searchsorted(ids, labels), 0, ids.shape[0] - 1)
    prob = jnp.take_along_axis(p, at[..., None], -1)[..., 0]
    prob = prob if ids is None else jnp.where(ids[at] == labels, prob, 0.0)
    return jnp.cumprod(jnp.concatenate([jnp.ones_like(prob[..., :1]), prob[..., :-1]], -1), -1)


def dense_kl(target_params, states, teacher, weights):
    head = lambda h, method: Target(TARGET).apply({"params": target_params}, h, method=method)
    logq = jax.nn.log_softmax(head(states, Target.head), axis=-1)
    logp = jax.nn.log_softmax(head(teacher, Target.logits), axis=-1)
    return jnp.sum(weights * jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1), axis=(0, 1))


@pytest.mark.parametrize("chunk", [7, pytest.param(1000, marks=pytest.mark.slow)])  # 1000: one chunk for all
def test_chunked_kl_and_gradient_equal_dense(chunk):
    B, T, K = 2, 16, 3
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    mask = np.zeros((B, T), np.int32)
    mask[0, 4:] = 1
    labels, weights = slot_targets(tokens, jnp.asarray(mask), K)
    target_params = init_target(TARGET, jax.random.key(1))
    states = jax.random.normal(jax.random.key(2), (B, T, K, TARGET.hidden_size))
    teacher = jax.random.normal(jax.random.key(4), (B, T, K, TARGET.hidden_size))

    kl = jax.jit(lambda s: chunked_slot_ce(TARGET, target_params, s, labels, weights, chunk, teacher)["ce_sum"])
    np.testing.assert_allclose(kl(states), jax.jit(dense_kl)(target_params, states, teacher, weights), rtol=1e-5,
                               atol=1e-6)
    assert float(jnp.min(kl(states))) >= 0.0
    g = jax.jit(jax.grad(lambda s: jnp.sum(kl(s))))(states)
    g_dense = jax.jit(jax.grad(lambda s: jnp.sum(dense_kl(target_params, s, teacher, weights))))(states)
    np.testing.assert_allclose(g, g_dense, rtol=1e-5, atol=1e-6)


def test_kl_teacher_is_the_targets_distribution_for_the_slots_label():
    """Under `kl`, slot i at t learns the distribution the target gives at t + 1 + i: the distribution over token
    t + 2 + i, the slot's CE label (so on greedy text the teacher's argmax is that label)."""
    cfg = TargetConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=8)
    params = init_target(cfg, jax.random.key(5))
    T, K = 12, 3
    tokens = jax.random.randint(jax.random.key(6), (1, T), 0, cfg.vocab_size)
    logits = Target(cfg).apply({"params": params}, tokens, target_cache(cfg, 1, T))[0][0]  # [T, V]
    hidden = target_hidden(cfg, params, tokens, (cfg.num_layers,))
    teacher = hidden[cfg.num_layers][:, slot_teacher_index(T, K)]  # [1, T, K, d]
    taught = Target(cfg).apply({"params": params}, teacher, method=Target.logits)[0]  # [T, K, V]
    labels, weights = slot_targets(tokens, jnp.ones_like(tokens), K)
    for t in range(T):
        for i in range(K):
            if weights[0, t, i] > 0:  # supervised: position t + 1 + i exists and predicts the label
                np.testing.assert_allclose(taught[t, i], logits[t + 1 + i], rtol=1e-5, atol=1e-5)
                assert int(labels[0, t, i]) == int(tokens[0, t + 2 + i])
    assert int(jnp.sum(weights)) == sum(max(0, T - 2 - i) for i in range(K))


def replay_reference(lead, mask):
    """Decoding replayed in plain Python: first answer token from the target, then rounds from the last prompt
    position."""
    emitted_total = rounds_total = 0
    for row, m in zip(np.asarray(lead), np.asarray(mask)):
        answer = int(m.sum())
        if answer == 0:
            continue
        q, emitted = int(np.argmax(m)) - 1, 1
        while emitted < answer:
            n = int(row[q])
            step = min(n + 1, answer - emitted)
            emitted, q, rounds_total = emitted + step, q + n + 1, rounds_total + 1
            emitted_total += step
    return emitted_total, rounds_total


def test_replayed_rounds_start_where_the_last_one_stopped():
    rng = np.random.default_rng(3)
    B, T, K = 6, 40, 4
    mask = np.zeros((B, T), np.int32)
    for b, (start, end) in enumerate([(5, 40), (10, 30), (0, 0), (39, 40), (20, 22), (1, 40)]):
        mask[b, start:end] = 1
    lead = rng.integers(0, K + 1, (B, T)).astype(np.int32)
    emitted, rounds = replay_rounds(jnp.asarray(lead), jnp.asarray(mask))
    assert (int(emitted), int(rounds)) == replay_reference(lead, mask)
    # all drafts right: every round emits K + 1 tokens until the answer runs out; none right: one token per round
    full = replay_rounds(jnp.full((B, T), K, jnp.int32), jnp.asarray(mask))
    none = replay_rounds(jnp.zeros((B, T), jnp.int32), jnp.asarray(mask))
    answers = mask.sum(1)
    assert int(none[0]) == int(none[1]) == int(np.maximum(answers - 1, 0).sum())
    assert int(full[1]) == int(sum(-(-(a - 1) // (K + 1)) for a in answers if a > 1))


@pytest.mark.slow  # CI time: an option of training's loss
def test_slot_decay_weighs_each_slots_loss():
    """The loss is the slots' losses weighted exp(-decay * i), normalised; decay 0 is their mean (the paper's); with
    reach, later slots weigh less again, and the metrics' sums stay the unweighted ones."""
    from specformer_jax.config import DrafterConfig
    from specformer_jax.modeling.drafter import init_drafter
    from specformer_jax.training.loss import drafter_loss

    cfg = TargetConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=8)
    params = init_target(cfg, jax.random.key(5))
    dcfg = DrafterConfig(num_slots=3)
    dparams = init_drafter(cfg, dcfg, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(6), (2, 12), 0, cfg.vocab_size)
    losses = {}
    for decay in (0.0, 0.7):
        losses[decay], sums = drafter_loss(dparams, params, tokens, jnp.ones_like(tokens), target_cfg=cfg,
                                           drafter_cfg=dcfg, slot_decay=decay)
    per_slot = np.asarray(sums["ce_sum"] / sums["count"])
    w = np.exp(-0.7 * np.arange(3))
    np.testing.assert_allclose(float(losses[0.0]), per_slot.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(losses[0.7]), (w * per_slot).sum() / w.sum(), rtol=1e-6)
    assert len(set(np.round(per_slot, 4))) == 3  # the slots' losses differ, so the weights matter
    reached, reached_sums = drafter_loss(dparams, params, tokens, jnp.ones_like(tokens), target_cfg=cfg,
                                         drafter_cfg=dcfg, slot_decay=0.7, reach=True)
    assert "reached_ce_sum" not in reached_sums  # the metrics stay unweighted
    np.testing.assert_allclose(reached_sums["ce_sum"], sums["ce_sum"], rtol=1e-6)
    assert w[0] * per_slot[0] / w.sum() < float(reached) < float(losses[0.7])  # slots 1, 2 weigh their reach (< 1)
