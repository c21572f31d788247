"""SpecFormer drafter module: shapes, slot/position alignment, cached vs full context layer, slot attention modes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.drafter import Drafter, drafter_cache, init_drafter
from specformer_jax.training.loss import following_tokens, slot_targets

TARGET = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=8)


def hidden_states(cfg: DrafterConfig, B, T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 8)
    return {i: jax.random.normal(keys[n], (B, T, TARGET.hidden_size)) for n, i in enumerate(cfg.resolved_hooks(TARGET))}


@functools.partial(jax.jit, static_argnames=("cfg", "num_slots"))
def run(cfg, params, hidden, cache, num_new=None, slots_at=None, num_slots=None, next_embed=None):
    return Drafter(TARGET, cfg).apply({"params": params}, hidden, cache, num_new, slots_at, num_slots, next_embed)


def test_default_hooks_and_shapes():
    cfg = DrafterConfig(num_slots=5)
    assert cfg.resolved_hooks(TARGET) == (0, 2, 3, 4)
    params = init_drafter(TARGET, cfg, jax.random.key(0)).weights
    assert params["fuse"]["kernel"].shape == (4 * 32, 32)
    assert params["expand"]["kernel"].shape == (32, 5 * 32) and params["expand"]["bias"].shape == (5 * 32,)
    states, cache = run(cfg, params, hidden_states(cfg, 2, 7), drafter_cache(TARGET, 2, 16))
    assert states.shape == (2, 7, 5, 32)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [7, 7])
    states, _ = run(cfg, params, hidden_states(cfg, 2, 7), drafter_cache(TARGET, 2, 16),
                    slots_at=jnp.asarray([[6], [2]]), num_slots=3)
    assert states.shape == (2, 1, 3, 32)


def test_slot_i_at_position_t_targets_token_t_plus_2_plus_i():
    tokens = jnp.arange(100, 110)[None, :]  # token value = 100 + position
    mask = jnp.ones_like(tokens).at[0, :4].set(0)  # prompt = first 4 tokens: not supervised
    labels, weights = slot_targets(tokens, mask, 3)
    for t in range(10):
        for i in range(3):
            if t + 2 + i < 10:
                assert int(labels[0, t, i]) == 100 + t + 2 + i
                assert float(weights[0, t, i]) == float(t + 2 + i >= 4)
            else:
                assert float(weights[0, t, i]) == 0.0
    # a next_token_input drafter at t is given token t + 1 in training (decoding: tests/test_speculative.py's oracle)
    np.testing.assert_array_equal(np.asarray(following_tokens(tokens))[0, :9], np.arange(101, 110))


def test_next_token_input_starts_as_the_paper_drafter_and_changes_only_its_own_position():
    paper, extended = DrafterConfig(num_slots=4), DrafterConfig(num_slots=4, next_token_input=True)
    params = init_drafter(TARGET, extended, jax.random.key(5)).weights
    paper_params = {k: v for k, v in params.items() if not k.startswith("next_")}
    assert set(params) - set(paper_params) == {"next_norm", "next_proj"}
    hidden, cache = hidden_states(paper, 2, 6), drafter_cache(TARGET, 2, 6)
    nxt = jax.random.normal(jax.random.key(6), (2, 6, TARGET.hidden_size))
    base, _ = run(paper, paper_params, hidden, cache)
    same, _ = run(extended, params, hidden, cache, next_embed=nxt)
    np.testing.assert_allclose(np.asarray(same), np.asarray(base), atol=1e-6)  # zero-initialised: continues exactly
    params["next_proj"]["kernel"] = jax.random.normal(jax.random.key(7), params["next_proj"]["kernel"].shape)
    a, _ = run(extended, params, hidden, cache, next_embed=nxt)
    b, _ = run(extended, params, hidden, cache, next_embed=nxt.at[:, 3].add(1.0))
    changed = ~np.isclose(np.asarray(a), np.asarray(b), atol=1e-6).all(axis=(2, 3))
    np.testing.assert_array_equal(changed, [[False, False, False, True, False, False]] * 2)
    with pytest.raises(ValueError, match="needs the embedding"):
        run(extended, params, hidden, cache)


@pytest.mark.parametrize("variant", ["bidirectional", "causal", "context_token"])
def test_cached_context_layer_equals_full_sequence_pass(variant):
    """A ragged prefill then one token at a time through the drafter's cache gives the full-pass slot states (with
    context_token_input, each position's next-token embedding goes in beside its states)."""
    cfg = DrafterConfig(num_slots=4, slot_attention="causal" if variant == "causal" else "bidirectional",
                        context_token_input=variant == "context_token")
    params = init_drafter(TARGET, cfg, jax.random.key(1)).weights
    B, T = 3, 9
    hidden = hidden_states(cfg, B, T, seed=2)
    nxt = jax.random.normal(jax.random.key(3), (B, T, TARGET.hidden_size)) if cfg.context_token_input else None
    full, _ = run(cfg, params, hidden, drafter_cache(TARGET, B, T), next_embed=nxt)
    prefix = jnp.asarray([4, 1, 6])
    cache = drafter_cache(TARGET, B, 16)
    first = {i: h[:, :6] for i, h in hidden.items()}  # right-padded to 6; each row keeps only its prefix
    states, cache = run(cfg, params, first, cache, num_new=prefix, next_embed=None if nxt is None else nxt[:, :6])
    got = [[states[b, t] for t in range(int(prefix[b]))] for b in range(B)]
    for step in range(T):
        pos = jnp.minimum(prefix + step, T - 1)
        live = (prefix + step < T).astype(jnp.int32)
        one = {i: jnp.take_along_axis(h, pos[:, None, None], axis=1) for i, h in hidden.items()}
        one_next = None if nxt is None else jnp.take_along_axis(nxt, pos[:, None, None], axis=1)
        states, cache = run(cfg, params, one, cache, num_new=live, next_embed=one_next)
        for b in range(B):
            if live[b]:
                got[b].append(states[b, 0])
    for b in range(B):
        np.testing.assert_allclose(np.stack(got[b]), np.asarray(full[b]), atol=1e-5, rtol=1e-5)


def perturb_last_slot(params, K, d):
    bias = params["expand"]["bias"].at[(K - 1) * d :].add(3.0)
    return {**params, "expand": {**params["expand"], "bias": bias}}


@pytest.mark.parametrize("slot_attention,earlier_slots_change", [("bidirectional", True), ("causal", False)])
def test_slot_attention_direction(slot_attention, earlier_slots_change):
    cfg = DrafterConfig(num_slots=4, slot_attention=slot_attention)
    params = init_drafter(TARGET, cfg, jax.random.key(3)).weights
    hidden = hidden_states(cfg, 2, 5)
    base, _ = run(cfg, params, hidden, drafter_cache(TARGET, 2, 5))
    moved, _ = run(cfg, perturb_last_slot(params, 4, 32), hidden, drafter_cache(TARGET, 2, 5))
    changed = not np.allclose(np.asarray(base[:, :, :3]), np.asarray(moved[:, :, :3]), atol=1e-6)
    assert changed == earlier_slots_change


@pytest.mark.parametrize("slot_attention", ["bidirectional", "causal"])
def test_fewer_slots_at_inference_are_a_prefix_of_all_slots(slot_attention):
    cfg = DrafterConfig(num_slots=6, slot_attention=slot_attention)
    params = init_drafter(TARGET, cfg, jax.random.key(4)).weights
    hidden = hidden_states(cfg, 2, 5)
    full, _ = run(cfg, params, hidden, drafter_cache(TARGET, 2, 5))
    few, _ = run(cfg, params, hidden, drafter_cache(TARGET, 2, 5), num_slots=2)
    np.testing.assert_allclose(np.asarray(few), np.asarray(full[:, :, :2]), atol=1e-6)


def test_bad_drafter_config_is_a_clear_error():
    from specformer_jax.errors import SpecformerError

    with pytest.raises(SpecformerError, match="slot_attention"):
        DrafterConfig(slot_attention="sideways")
    with pytest.raises(SpecformerError, match="out of range"):
        DrafterConfig(hooks=(0, 9)).resolved_hooks(TARGET)
