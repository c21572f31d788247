"""Speculative sampling keeps the target's distribution: chi-square of sampled tokens against the exact one."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance import speculative
from specformer_jax.decoding.acceptance.sampling import SamplingConfig, process_logits
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts import draft_source, hybrid
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.ngram import NgramDrafts
from specformer_jax.decoding.engine import budget, runner
from specformer_jax.modeling.calibration import BINS
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.loaded import LoadedDrafter
from specformer_jax.modeling.target import Target

PROMPT = [5, 17, 3, 99, 42, 7, 8]
RECURRING = list(range(1, 128, 2))  # half the vocabulary: a sampled token often recurs, so n-gram drafts are common
SAMPLING = SamplingConfig(temperature=1.0, top_k=5)
ROWS = 3000


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"])


@pytest.fixture(scope="module")
def drafter(model):
    cfg = DrafterConfig(num_slots=3)
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(5)), {})


def next_token_probs(model, prefixes, prompt=PROMPT):
    """Exact processed next-token distribution after each prefix (float64), from one batched forward.

    Prefixes are right-padded into one fixed [SUPPORT, len(prompt) + 2] batch, so a single compilation serves all."""
    rows, width = SAMPLING.top_k, len(prompt) + 2
    assert len(prefixes) <= rows and max(map(len, prefixes)) <= width
    tokens = np.zeros((rows, width), np.int32)
    lens = np.ones((rows,), np.int32)
    for r, p in enumerate(prefixes):
        tokens[r, : len(p)], lens[r] = p, len(p)
    probs = _next_token_probs(model.cfg, model.params, jnp.asarray(tokens), jnp.asarray(lens))
    return np.asarray(probs, np.float64)[: len(prefixes)]


@functools.partial(jax.jit, static_argnums=0)
def _next_token_probs(cfg, params, tokens, lens):
    cache = KVCache.zeros(cfg.num_layers, tokens.shape[0], tokens.shape[1], cfg.num_kv_heads, cfg.head_dim)
    logits = Target(cfg).apply({"params": params}, tokens, cache, lens, (lens - 1)[:, None])[0][:, 0]
    return jax.nn.softmax(process_logits(logits, SAMPLING))


def exact_joint_of_tokens_2_and_3(model, prompt=PROMPT):
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), over the top-k supports."""
    p1 = next_token_probs(model, [prompt], prompt)[0]
    joint = {}
    for t1 in np.nonzero(p1)[0]:
        p2 = next_token_probs(model, [prompt + [int(t1)]], prompt)[0]
        seconds = np.nonzero(p2)[0]
        p3 = next_token_probs(model, [prompt + [int(t1), int(t2)] for t2 in seconds], prompt)
        for t2, row in zip(seconds, p3):
            for t3 in np.nonzero(row)[0]:
                joint[(int(t2), int(t3))] = joint.get((int(t2), int(t3)), 0.0) + p1[t1] * p2[t2] * row[t3]
    return joint


def chi_square_pvalue(samples, joint):
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    assert set(counts) <= set(joint)  # nothing outside the top-k supports
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.array([joint[c] * len(samples) for c in cells])
    observed = np.array([counts.get(c, 0) for c in cells], float)
    big = expected >= 5  # pool the rare cells so the chi-square approximation holds
    exp_b = np.append(expected[big], expected[~big].sum())
    obs_b = np.append(observed[big], observed[~big].sum())
    return scipy.stats.chisquare(obs_b, exp_b * obs_b.sum() / exp_b.sum()).pvalue


def sample_tokens_2_and_3(model, drafter, seed, prompt=PROMPT, verify_budget=0):
    res = generate(model, [prompt] * ROWS, max_new_tokens=3, temperature=SAMPLING.temperature, top_k=SAMPLING.top_k,
                   batch_size=1000, seed=seed, drafter=drafter, draft_len=3, verify_budget=verify_budget)
    assert 1.0 <= res.stats["mean_accepted_length"] <= 4.0
    return [tuple(ids[1:3]) for ids in res.token_ids], res.stats


def variant_drafter(model, variant: str):
    """The n-gram lookup ("ngram", its drafts deterministic: q a point mass), a hybrid choosing it for rows whose last
    token recurs and a random drafter for the others ("hybrid", each row verified against its own q), or a random
    drafter that reads the token after its position: at the slots (next_token_input; its zero-initialised
    projection made to matter) or at the context layer (context_token_input); or one whose head spans half the
    vocabulary (draft_vocab: q is zero on the other half, where the target's samples still land)."""
    if variant == "ngram":
        return NgramDrafts()
    if variant == "hybrid":  # calibrated as accepted 2% of the time: the lookup wins wherever it matched
        unsure = {"count": [[100] * BINS] * 3, "accepted": [[2] * BINS] * 3, "confidence_sum": [[50] * BINS] * 3}
        d = variant_drafter(model, "draft_vocab")
        return Hybrid(dataclasses.replace(d, meta={"eval": {"calibration": unsure}}), min_match=1)
    cfg = DrafterConfig(num_slots=3, next_token_input=variant == "slots", context_token_input=variant == "context",
                        draft_vocab_size=64 if variant == "draft_vocab" else None)
    vocab = np.sort(np.random.default_rng(1).permutation(128)[:64]) if cfg.draft_vocab_size else None
    params = init_drafter(model.cfg, cfg, jax.random.key(6), vocab)
    if cfg.next_token_input:
        w = params.weights["next_proj"]["kernel"]
        params.weights["next_proj"]["kernel"] = 0.05 * jax.random.normal(jax.random.key(9), w.shape, w.dtype)
    return LoadedDrafter(cfg, params, {})


# CI time: the shipped drafter's kind (a draft vocabulary) in `make test`, the paper's plain drafter with -m slow
@pytest.mark.parametrize("variant", [pytest.param("paper", marks=pytest.mark.slow), "draft_vocab",
                                     pytest.param("ngram", marks=pytest.mark.slow),
                                     pytest.param("hybrid", marks=pytest.mark.slow),
                                     pytest.param("slots", marks=pytest.mark.slow),
                                     pytest.param("context", marks=pytest.mark.slow)])
def test_speculative_samples_follow_the_target_distribution(model, drafter, variant):
    prompt = RECURRING if variant in ("ngram", "hybrid") else PROMPT
    joint = exact_joint_of_tokens_2_and_3(model, prompt)
    samples, stats = sample_tokens_2_and_3(model, drafter if variant == "paper" else variant_drafter(model, variant),
                                           seed=11, prompt=prompt)
    assert 0 < stats["acceptance_rate_per_slot"][0] < 1  # both acceptance and rejection paths are exercised
    for by in stats["by_source"].values() if variant == "hybrid" else ():  # both sources drafted, some of each accepted
        assert by["share_of_rounds"] > 0.2 and by["acceptance_rate_per_slot"][0] > 0.01
    assert chi_square_pvalue(samples, joint) > 1e-3


@pytest.mark.slow  # CI time: the chi-square tests run in `make test`, their power checks with -m slow
def test_the_test_catches_a_verifier_that_ignores_q(model, drafter, monkeypatch):
    """The power check of the test above: with q mishandled, the same samples fail it."""
    real = speculative.verify

    def ignores_q(logits, drafts, q, keys, sampling, limit=None):  # treats every draft as if drawn uniformly
        return real(logits, drafts, jnp.full_like(q, 1.0 / q.shape[-1]), keys, sampling, limit)

    monkeypatch.setattr(speculative, "verify", ignores_q)
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())  # do not reuse the correct compiled ones
    joint = exact_joint_of_tokens_2_and_3(model)
    samples, _ = sample_tokens_2_and_3(model, drafter, seed=11)
    assert chi_square_pvalue(samples, joint) < 1e-6


BUDGET = 1000 + 1200  # every row's last token and 1,200 of the pool's 3,000 drafts: rows cut at 0, 1, 2 and 3


def test_samples_with_a_verify_budget_follow_the_target_distribution(model, drafter):
    """A budget cuts the rows of one round at different lengths (engine/budget.py); each row's rejection rule runs
    over its own verified drafts, and a row that accepts all of them draws its bonus token from the target there."""
    joint = exact_joint_of_tokens_2_and_3(model)
    samples, stats = sample_tokens_2_and_3(model, drafter, seed=12, verify_budget=BUDGET)
    assert 1.5 < stats["verified_positions_per_round"] < 3.5 and 0 < stats["rounds_without_drafts"] < 0.5
    assert 0 < stats["acceptance_rate_per_slot"][0] < 1
    assert chi_square_pvalue(samples, joint) > 1e-3


@pytest.mark.slow  # CI time: a power check; the budget's own chi-square runs
def test_the_test_catches_a_flat_layout_read_one_entry_off(model, drafter, monkeypatch):
    """The power check of the budget's test: each position verified against the logits of the entry after it in
    the flat list (an off-by-one between the layout and its reading)."""
    real = budget.gather_rows
    monkeypatch.setattr(budget, "gather_rows", lambda x, index: real(x, index + 1))
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())
    joint = exact_joint_of_tokens_2_and_3(model)
    samples, _ = sample_tokens_2_and_3(model, drafter, seed=12, verify_budget=BUDGET)
    with pytest.raises(AssertionError):  # tokens outside the target's top-k supports, or a failed chi-square
        assert chi_square_pvalue(samples, joint) > 1e-6


@pytest.mark.slow  # CI time: a power check, as the ones above
def test_the_test_catches_a_hybrid_that_verifies_with_the_wrong_q(model, monkeypatch):
    """The power check for the hybrid: n-gram rows verified against the drafter's q instead of their point mass."""
    real = hybrid.point_mass

    def spread(plan, drafts):  # a uniform q: wrong for the n-gram's deterministic drafts
        return jnp.full_like(real(plan, drafts), 1.0 / plan.cfg.vocab_size)

    monkeypatch.setattr(hybrid, "point_mass", spread)
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())
    joint = exact_joint_of_tokens_2_and_3(model, RECURRING)
    samples, _ = sample_tokens_2_and_3(model, variant_drafter(model, "hybrid"), seed=11, prompt=RECURRING)
    assert chi_square_pvalue(samples, joint) < 1e-6


@pytest.mark.slow  # CI time: a power check, as the ones above
def test_the_test_catches_a_draft_vocabulary_q_left_unmapped(model, monkeypatch):
    """The same power check for a draft vocabulary: q over V' written at token ids 0..V'-1 instead of at its tokens."""
    real = speculative.choose_drafts

    def unmapped(logits, keys, sampling, vocab=None, vocab_size=0):
        drafts, q = real(logits, keys, sampling, vocab, vocab_size)
        q_small = jax.nn.softmax(process_logits(logits, sampling), axis=-1)
        return drafts, jnp.zeros_like(q).at[..., : q_small.shape[-1]].set(q_small)

    monkeypatch.setattr(draft_source, "choose_drafts", unmapped)
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())
    joint = exact_joint_of_tokens_2_and_3(model)
    samples, _ = sample_tokens_2_and_3(model, variant_drafter(model, "draft_vocab"), seed=11)
    assert chi_square_pvalue(samples, joint) < 1e-6
