"""On-device AR decoding: sampling filters, the sampled distribution, per-row EOS and budgets, batching."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import transformers

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.acceptance.sampling import SamplingConfig, greedy_tokens, process_logits
from specformer_jax.decoding.api import generate

ROWS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72]]


def numpy_filter(logits, temperature, top_k, top_p):
    """Independent reference: keep the top-k, then the smallest prefix (by probability) with mass >= top_p."""
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    keep[order[: top_k or len(x)]] = True
    p = np.exp(x - x.max()) * keep
    p /= p.sum()
    mass = 0.0
    kept = np.zeros_like(keep)
    for i in order:
        if not keep[i] or mass >= top_p:
            break
        kept[i] = True
        mass += p[i]
    return np.where(kept, x, -np.inf)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)])
def test_process_logits_matches_numpy(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    got = np.asarray(process_logits(jnp.asarray(logits), SamplingConfig(temperature, top_k, top_p)))
    for row, g in zip(logits, got):
        want = numpy_filter(row.astype(np.float64), temperature, top_k, top_p)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(want))
        np.testing.assert_allclose(g[~np.isinf(g)], want[~np.isinf(want)], rtol=1e-6)


def test_greedy_tokens_pick_numpys_first_largest_logit():
    """The greedy choice (a maximum, then the least index holding it) against numpy's argmax, which takes the first
    of tied maxima: ties placed first, last and apart, rows of -inf, rows of a few values (many ties), and [B, k, V]
    shapes as a round's logits come."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 3, 4099)).astype(np.float32)
    logits[0, 0, [7, 4000]] = logits[0, 0, 4098] = 9.0
    logits[1, 1, [0, 4098]] = 9.0
    logits[2, 2] = -np.inf
    logits[3] = rng.integers(0, 3, size=(3, 4099)).astype(np.float32)
    logits[4, 0, -1] = 50.0
    np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(logits))), np.argmax(logits, axis=-1))
    assert greedy_tokens(jnp.asarray(logits)).dtype == jnp.int32


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


def test_sampled_first_tokens_follow_transformers_distribution(llama, tiny_checkpoints):
    """2000 independent rows (own RNG key each) sample one token; chi-square against softmax(HF logits / T), top-k 8."""
    T, k, n = 0.8, 8, 2000
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama3"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ROWS[0]])).logits[0, -1].double().numpy()
    probs = np.exp(numpy_filter(logits, T, k, 1.0) - logits.max() / T)
    probs /= probs.sum()
    res = generate(llama, [ROWS[0]] * n, max_new_tokens=1, temperature=T, top_k=k, batch_size=500, seed=3)
    counts = np.bincount([ids[0] for ids in res.token_ids], minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0  # nothing outside the top-k
    chi2 = scipy.stats.chisquare(counts[support], probs[support] * n)
    assert chi2.pvalue > 1e-3, chi2
    # and the test has power: the same check refuses the same counts against the unfiltered, untempered distribution
    plain = np.exp(logits - logits.max())
    plain /= plain.sum()
    wrong = plain[support] / plain[support].sum() * n
    assert scipy.stats.chisquare(counts[support], wrong).pvalue < 1e-3


def test_per_row_eos_and_budget_match_transformers(llama, tiny_checkpoints):
    free = generate(llama, ROWS, max_new_tokens=10)
    row0 = free.token_ids[0]
    j = next(i for i in range(2, len(row0)) if row0[i] not in row0[:i])  # first new token after step 2 becomes EOS
    eos = row0[j]
    model = dataclasses.replace(llama, eos_ids=(eos,))
    res = generate(model, ROWS, max_new_tokens=10)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama3"], dtype=torch.float32).eval()
    for r, ids in zip(ROWS, res.token_ids):
        ref = hf.generate(torch.tensor([r]), do_sample=False, max_new_tokens=10, eos_token_id=eos, pad_token_id=0)
        assert ids == ref[0, len(r) :].tolist()
    assert len(res.token_ids[0]) == j + 1 and res.token_ids[0][-1] == eos
    assert res.stats["num_generated"] == sum(len(t) for t in res.token_ids)


@pytest.mark.slow  # CI time: test_engine.py decodes each request as alone
def test_batch_composition_does_not_change_outputs(llama):
    for kw in (dict(), dict(temperature=1.0, top_p=0.9, seed=7)):
        whole = generate(llama, ROWS, max_new_tokens=8, batch_size=8, **kw).token_ids
        chunked = generate(llama, ROWS, max_new_tokens=8, batch_size=2, **kw).token_ids
        assert whole == chunked


def test_seed_changes_samples_and_is_reproducible(llama):
    a = generate(llama, ROWS, max_new_tokens=8, temperature=1.0, seed=1).token_ids
    b = generate(llama, ROWS, max_new_tokens=8, temperature=1.0, seed=1).token_ids
    c = generate(llama, ROWS, max_new_tokens=8, temperature=1.0, seed=2).token_ids
    assert a == b and a != c


def test_decode_steps_count_loop_iterations_without_the_prefill(llama):
    no_eos = dataclasses.replace(llama, eos_ids=())
    stats = generate(no_eos, [[1, 5, 9]], max_new_tokens=8).stats
    assert stats["num_generated"] == 8 and stats["decode_steps"] == 7  # the prefill emits the first token
