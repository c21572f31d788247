"""Decoding with n-gram drafts and the hybrid (decoding/ngram.py, hybrid.py): lossless against plain decoding of
each prompt alone on ragged, refilled pools; stats per source that add up; the names a user gives them."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import BUDGETS, PROMPTS, N, plain_alone, run

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.drafts.hybrid import Hybrid, HybridDrafts, takes_lookup
from specformer_jax.decoding.drafts.kinds import draft_source, max_draft_len
from specformer_jax.decoding.drafts.ngram import NgramDrafts, expected_accepted, match_acceptance
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.decoding.tuning.draft_len import default_draft_len, hybrid_model_len
from specformer_jax.defaults import NGRAM_ACCEPTANCE
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.loaded import LoadedDrafter

COPY = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
        "Fix the typo and return the code: def add(a, b):\n    retrun a + b\n\nprint(add(2, 3))"]
LOOPS = [[(i % p) + 10 for i in range(n)] for p, n in ((3, 20), (5, 12), (2, 7), (7, 30))]  # prompts that repeat


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    """test_engine's model: an EOS that some answers reach mid-round."""
    m = load_target(tiny_checkpoints["qwen2"])
    free = plain_alone(m, PROMPTS[0], N)
    return dataclasses.replace(m, eos_ids=(next(t for t in free[3:] if t not in free[:3]),))


@pytest.fixture(scope="module")
def reference(model):
    return [plain_alone(model, p, b) for p, b in zip(PROMPTS, BUDGETS)]


def specformer(model, slots=3) -> LoadedDrafter:
    cfg = DrafterConfig(num_slots=slots)
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(3)), {})


def sources(model):
    d = specformer(model)
    return {"ngram": NgramDrafts(), "ngram:2-3": NgramDrafts(max_n=3, min_n=2),
            "hybrid": HybridDrafts(SpecformerDrafts(d.cfg, d.params), NgramDrafts(), min_match=1, model_len=2)}


# CI time: one of the six cases (the rest run with -m slow; the hybrid decodes the default model in `make test`)
@pytest.mark.parametrize("name, k", [("ngram", 2)] + [pytest.param(n, k, marks=pytest.mark.slow) for
                                                      n, k in (("hybrid", 6), ("ngram", 6), ("ngram:2-3", 2),
                                                               ("ngram:2-3", 6), ("hybrid", 2))])
def test_ngram_and_hybrid_drafts_are_lossless_on_a_refilled_pool(model, reference, name, k):
    """11 ragged requests (EOS and budgets inside rounds) through a pool of 3, refilled as rows finish. With k = 6
    the hybrid drafts past the drafter's 3 trained slots."""
    plan = make_plan(model, k, SamplingConfig(), N)
    assert run(plan, model, sources(model)[name], pool=3, rounds=4)[0] == reference


def test_an_ngram_draft_is_valued_by_its_match_length():
    """A looked-up draft's chance is the measured table's at the row's match length and slot: none without a match,
    the last row past the table, the row's last value past its slots; the expected accepted drafts are the sums of
    the chain's products (a loop here)."""
    got = np.asarray(match_acceptance(jnp.asarray([0, 1, 4, 9]), 10))
    table = np.asarray(NGRAM_ACCEPTANCE)
    np.testing.assert_allclose(got[0], 0)
    np.testing.assert_allclose(got[1, :8], table[0])
    np.testing.assert_allclose(got[2, :8], table[3])
    np.testing.assert_allclose(got[3], got[2])
    np.testing.assert_allclose(got[1, 8:], table[0, -1])
    chances = np.array([[0.9, 0.5, 0.5, 1.0], [0.2, 1.0, 1.0, 1.0]], np.float32)
    for width in (1, 2, 3):
        want = [sum(np.prod(row[: j + 1]) for j in range(width)) for row in chances]
        np.testing.assert_allclose(np.asarray(expected_accepted(jnp.asarray(chances), width)), want, rtol=1e-6)


def test_a_hybrid_row_takes_the_drafts_it_expects_more_of_accepted():
    """At batch 1 on a CPU (the drafter's rows verify 3 drafts, the n-gram's 7): a row with no match, or a match
    shorter than min_match, keeps its drafter's drafts; a long match beats a drafter of middling confidence; a match
    of 2 tokens beats an unsure drafter but not a sure one."""
    match = jnp.asarray([0, 1, 4, 2, 2])
    mine = jnp.asarray([[0.1] * 7, [0.1] * 7, [0.6] * 7, [0.2] * 7, [0.99] * 7], jnp.float32)
    use = takes_lookup(match, mine, match_acceptance(match, 7), (3, 7), min_match=2)
    assert np.asarray(use).tolist() == [False, False, True, True, False]
    assert np.asarray(takes_lookup(match, mine, match_acceptance(match, 7), (3, 7), min_match=1))[1]


@pytest.mark.slow  # CI time: test_flat_verify.py counts a hybrid's rounds per source
def test_the_hybrid_counts_rounds_and_tokens_per_source(model, reference):
    plan = make_plan(model, 4, SamplingConfig(), N)
    _, result = run(plan, model, sources(model)["hybrid"], pool=3, rounds=4)
    stats = result.speculative_stats()
    by = stats["by_source"]
    assert set(by) == {"specformer", "ngram"} and all(by[s]["rounds"] > 0 for s in by)
    assert by["specformer"]["rounds"] + by["ngram"]["rounds"] == stats["rounds"]
    assert sum(by[s]["share_of_rounds"] for s in by) == pytest.approx(1.0)
    emitted = sum(by[s]["mean_accepted_length"] * by[s]["rounds"] for s in by)
    assert emitted == pytest.approx(stats["mean_accepted_length"] * stats["rounds"])
    per_row = [sum(by[s]["per_row"]["rounds"][r] for s in by) for r in range(len(PROMPTS))]
    assert per_row == stats["per_row"]["rounds"]
    for s in by:  # slot i accepted at most as often as slot i - 1, in every source's rounds
        rates = by[s]["acceptance_rate_per_slot"]
        assert all(a >= b for a, b in zip(rates, rates[1:])) and len(rates) == 4


@pytest.fixture(scope="module")
def smollm2():
    return load_target("default")


@pytest.mark.slow  # CI time: the default model twice; lossless n-gram rows run below
def test_copied_text_is_drafted_and_accepted(smollm2):
    """A model that copies (the default, asked to repeat a text) accepts long n-gram drafts: the history holds the
    right tokens at the right positions (a random model's answers never repeat, so its tests cannot show it).
    Greedy output equals plain decoding's; the hybrid's n-gram rows are the lookup's (alone, it is lossless on the
    random models below)."""
    plain = generate(smollm2, COPY, max_new_tokens=40, batch_size=2)
    hybrid = generate(smollm2, COPY, max_new_tokens=40, batch_size=2, drafter="default+ngram", draft_len=6)
    assert hybrid.token_ids == plain.token_ids
    assert hybrid.stats["by_source"]["ngram"]["mean_accepted_length"] > 3


def test_default_and_largest_draft_lengths(model):
    d = specformer(model, slots=4)
    cpu = jax.default_backend() == "cpu"
    assert max_draft_len(d) == 4 and max_draft_len(NgramDrafts()) == max_draft_len(Hybrid(d)) == 16
    assert [default_draft_len(NgramDrafts(), b, True) for b in (1, 2, 8)] == ([7, 2, 0] if cpu else [4, 4, 4])
    assert [default_draft_len(Hybrid(d), b, True) for b in (1, 2, 8)] == ([7, 4, 0] if cpu else [4, 4, 4])
    packed, unpacked = (dataclasses.replace(model.cfg, pack_weights=p) for p in (True, False))
    # a hybrid's rounds with no n-gram row verify 3 SpecFormer drafts at batch 1 with the CPU kernels, else as many
    # as the drafter alone (at least one), never more than its slots; off a CPU the widths are (slots, k) but unused:
    # every chunk there verifies all k
    widths = lambda d, b, cfg: draft_source(Hybrid(d), None, cfg, hybrid_model_len(Hybrid(d), b, cfg)).widths(
        make_plan(model, 7, SamplingConfig(), N))
    assert [widths(d, b, packed) for b in (1, 2, 8)] == ([(3, 7), (2, 7), (1, 7)] if cpu else [(4, 7)] * 3)
    assert widths(specformer(model, slots=2), 1, packed) == (2, 7)
    assert widths(d, 1, unpacked) == ((1, 7) if cpu else (4, 7))
    with pytest.raises(SpecformerError, match="0..16"):
        generate(model, LOOPS, drafter="ngram", draft_len=17)
    with pytest.raises(SpecformerError, match="auto needs a SpecFormer drafter alone"):
        generate(model, LOOPS, drafter="ngram", draft_len="auto")


def test_names_are_parsed_or_refused(model, tmp_path):
    assert resolve_drafter("ngram", model) == NgramDrafts()
    assert resolve_drafter("ngram:2-6", model) == NgramDrafts(max_n=6, min_n=2)
    for bad, message in (("+ngram", "DRAFTER\\+ngram"), ("ngram:3", "ngram:MIN-MAX"),
                         (f"{tmp_path}/none+ngram", "does not exist")):
        with pytest.raises(SpecformerError, match=message):
            resolve_drafter(bad, model)
    with pytest.raises(SpecformerError, match="min_match"):
        Hybrid(specformer(model), NgramDrafts(max_n=2), min_match=3)


def test_the_cli_decodes_a_users_model_with_ngram_drafts(tiny_checkpoints, tmp_path, capsys, cli_error):
    """`specformer generate --model HF_DIR --drafter ngram`: no drafter trained for the model, same tokens."""
    from specformer_jax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in LOOPS))
    outs = []
    for drafter in ("none", "ngram"):
        argv = ["generate", "--model", str(tiny_checkpoints["qwen2"]), "--prompts-file", str(prompts), "--no-chat",
                "--json", "--max-new-tokens", "12", "--batch-size", "1", "--drafter", drafter]
        assert main(argv) == 0
        captured = capsys.readouterr()
        outs.append(json.loads(captured.out))
    assert [r["token_ids"] for r in outs[0]["results"]] == [r["token_ids"] for r in outs[1]["results"]]
    assert outs[1]["stats"]["drafter"] == "ngram" and outs[1]["stats"]["draft_len"] > 0  # drafts by default
    assert "mean accepted length" in captured.err
    line = cli_error(["generate", "--model", str(tiny_checkpoints["qwen2"]), "--prompt", "hi", "--drafter",
                      "ngram:4-2"])
    assert "min_n" in line
