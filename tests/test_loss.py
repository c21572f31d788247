"""The chunked drafter loss equals a dense computation (values and gradients), however positions are chunked and
wherever the supervised positions lie (chunks without any are skipped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.config import TargetConfig
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.target import Target
from specformer_jax.training.loss import chunked_slot_ce, slot_targets

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
            "count": jnp.sum(weights, axis=(0, 1)), "accepted_sum": jnp.sum(jnp.where(full, lead, 0)).astype(jnp.float32),
            "accepted_at_least": jnp.stack([jnp.sum(full & (lead > i)) for i in range(K)]).astype(jnp.float32),
            "positions": jnp.sum(full).astype(jnp.float32)}


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradient_equal_dense(chunk):
    B, T, K = 3, 20, 3
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    mask = np.zeros((B, T), np.int32)
    mask[0, 5:15] = 1  # answers in the middle, at the end, and a row with none
    mask[1, 12:] = 1
    labels, weights = slot_targets(tokens, jnp.asarray(mask), K)
    cache = KVCache.zeros(TARGET.num_layers, 1, 1, TARGET.num_kv_heads, TARGET.head_dim, TARGET.dtype)
    target_params = Target(TARGET).init(jax.random.key(1), jnp.zeros((1, 1), jnp.int32), cache)["params"]
    states = jax.random.normal(jax.random.key(2), (B, T, K, TARGET.hidden_size))

    got = chunked_slot_ce(TARGET, target_params, states, labels, weights, chunk)
    want = dense_sums(target_params, states, labels, weights)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)

    loss = lambda fn: lambda s: jnp.sum(fn(s)["ce_sum"])
    g_chunked = jax.grad(loss(lambda s: chunked_slot_ce(TARGET, target_params, s, labels, weights, chunk)))(states)
    g_dense = jax.grad(loss(lambda s: dense_sums(target_params, s, labels, weights)))(states)
    np.testing.assert_allclose(g_chunked, g_dense, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g_dense[2]).max()) == 0.0  # the unsupervised row gets no gradient
