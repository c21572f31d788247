"""The flat verify pass (a round's chosen positions as one list, each with its row and position) against the padded
pass it replaces: the target's states, logits and cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.ngram import NgramDrafts
from specformer_jax.decoding.engine.budget import best_size, chosen_lengths, draft_values, flat_layout
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.decoding.tuning import tuner
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.kv_cache import target_cache
from specformer_jax.modeling.target import Target


@pytest.mark.parametrize("layout", ["stacked", "packed"])
def test_a_flat_pass_computes_what_the_padded_pass_computes_at_the_positions_it_holds(layout):
    """Rows of different cache lengths verify 3, 0, 1 and 2 drafts; the flat pass holds only those positions (and
    padding placed past the cache's end), and gives the padded pass's states and cache at each of them."""
    model = load_target("random:tiny", dtype="float32")
    if layout == "packed":
        model = model.use_decoding_layout(4)
    cfg, params = model.cfg, model.params
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, cfg.vocab_size, (4, 12)), jnp.int32)
    lens = jnp.asarray([12, 5, 9, 7], jnp.int32)
    _, cache, _ = Target(cfg).apply({"params": params}, prompts, target_cache(cfg, 4, 32), lens)
    cache = cache.replace(lengths=lens)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (4, 4)), jnp.int32)  # [x, d_1, d_2, d_3] per row
    want, want_cache, _ = Target(cfg).apply({"params": params}, tokens, cache, method=Target.forward)
    chosen = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)]
    rows = jnp.asarray([b for b, _ in chosen] + [0, 0], jnp.int32)  # two padding positions
    at = jnp.asarray([j for _, j in chosen] + [0, 0], jnp.int32)
    positions = jnp.where(jnp.arange(12) < len(chosen), lens[rows] + at, cache.max_len)
    got, got_cache, _ = Target(cfg).apply({"params": params}, tokens[rows, at], rows, positions, cache,
                                          method=Target.forward_flat)
    index = tuple(jnp.asarray(x) for x in zip(*chosen))
    np.testing.assert_allclose(got[: len(chosen)], want[index], rtol=1e-5, atol=1e-5)
    assert (got_cache.lengths == lens).all()
    for b, j in chosen:
        np.testing.assert_allclose(got_cache.k[:, b, :, lens[b] + j], want_cache.k[:, b, :, lens[b] + j], atol=1e-6)
    untouched = cache.k[:, 1, :, 6:]  # row 1 verified x alone: nothing after it was written
    np.testing.assert_array_equal(got_cache.k[:, 1, :, 6:], untouched)


GREEDY_PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72], [11, 12],
                  [100, 101, 102, 103, 104], [60], [7, 7, 7, 8, 8, 8, 9, 9]]


@pytest.fixture(scope="module")
def tiny():
    model = load_target("random:tiny", dtype="float32")
    return model, resolve_drafter("random", model)


# CI time: the ragged pool of 3 rows in `make test` (its budgets cut rows at every length), 1 row with -m slow
@pytest.mark.parametrize("batch, budgets", [pytest.param(1, (1, 2, 4), marks=pytest.mark.slow), (3, (3, 7, 12))])
def test_greedy_output_with_a_verify_budget_is_plain_output_for_every_row(tiny, batch, budgets):
    """Budgets from none (every row verifies its last token alone) to every draft, on a ragged pool refilled as rows
    finish: every row equals plain greedy decoding, and the stats count what the budgets allowed."""
    model, drafter = tiny
    plain = generate(model, GREEDY_PROMPTS, max_new_tokens=16, batch_size=batch, chat=False).token_ids
    for budget in budgets:
        out = generate(model, GREEDY_PROMPTS, max_new_tokens=16, batch_size=batch, chat=False, drafter=drafter,
                       draft_len=3, verify_budget=budget)
        assert out.token_ids == plain, budget
        stats = out.stats
        assert stats["verify_budget"] == budget
        assert 1 <= stats["verified_positions_per_round"] <= min(4, budget) + 1e-9
        if budget == batch:  # drafts only where rows have finished and left their positions to the others
            assert stats["rounds_without_drafts"] > 0.5 if batch > 1 else stats["rounds_without_drafts"] == 1
        if budget >= 4 * batch:
            assert stats["verified_positions_per_round"] == 4 and stats["rounds_without_drafts"] == 0


@pytest.mark.parametrize("source", [pytest.param("ngram", marks=pytest.mark.slow), "hybrid"])  # the hybrid has both
def test_n_gram_rows_compete_in_the_same_budget_and_stay_lossless(tiny, source):
    """Rows whose drafts are looked up rank by the n-gram prior, the drafter's by their probabilities, in one
    budget; prompts that repeat themselves give the lookup matches."""
    model, drafter = tiny
    prompts = [p * 3 for p in GREEDY_PROMPTS]
    plain = generate(model, prompts, max_new_tokens=16, batch_size=3, chat=False).token_ids
    drafts = NgramDrafts() if source == "ngram" else Hybrid(drafter, min_match=1)
    out = generate(model, prompts, max_new_tokens=16, batch_size=3, chat=False, drafter=drafts, draft_len=4,
                   verify_budget=6)
    assert out.token_ids == plain
    assert 1 < out.stats["verified_positions_per_round"] < 5
    if source == "hybrid":
        assert all(by["rounds"] > 0 for by in out.stats["by_source"].values())


def test_a_budget_below_the_batch_size_is_refused(tiny):
    model, drafter = tiny
    with pytest.raises(SpecformerError, match="verify_budget must be 0 or at least the batch size, 3"):
        generate(model, GREEDY_PROMPTS, max_new_tokens=4, batch_size=3, chat=False, drafter=drafter, draft_len=2,
                 verify_budget=2)
    with pytest.raises(SpecformerError, match="--verify-budget auto needs a SpecFormer drafter alone"):
        generate(model, GREEDY_PROMPTS, max_new_tokens=4, batch_size=3, chat=False, drafter=NgramDrafts(),
                 draft_len=2, verify_budget="auto")


def test_the_budget_goes_to_the_most_valuable_drafts_and_each_row_keeps_a_prefix():
    """Values are chances that a draft and those before it are accepted; the choice fills the budget after every
    live row's last token with the highest ones (none of value 0, none of a row that is not live), and the flat
    layout holds each row's [x, d_1..d_m] on consecutive entries."""
    conf = jnp.asarray([[0.9, 0.9, 0.9], [0.2, 1.0, 1.0], [0.99, 0.5, 0.9], [1.0, 1.0, 1.0], [0.95, 0.0, 1.0]])
    live = jnp.asarray([True, True, True, False, True])
    values = draft_values(conf, live)
    np.testing.assert_allclose(values[2], [0.99, 0.495, 0.4455], rtol=1e-6)
    assert (values[3] == -1).all()
    for budget, want in [(4, [0, 0, 0, 0, 0]), (5, [0, 0, 1, 0, 0]), (7, [1, 0, 1, 0, 1]), (8, [2, 0, 1, 0, 1]),
                         (20, [3, 3, 3, 0, 1])]:
        chosen = chosen_lengths(values, live, budget)
        assert chosen.tolist() == want, budget
        index, rows, at, valid = flat_layout(live, chosen, 3, budget)
        entries = [(b, j) for b in range(5) if live[b] for j in range(want[b] + 1)]
        assert rows[: len(entries)].tolist() == [b for b, _ in entries]
        assert at[: len(entries)].tolist() == [j for _, j in entries]
        assert valid.tolist() == [i < len(entries) for i in range(budget)]
        for i, (b, j) in enumerate(entries):
            assert index[b, j] == i
        assert int(jnp.sum(index < budget)) == len(entries)


def test_each_round_takes_the_size_with_the_most_expected_tokens_per_cost():
    """Expected tokens of a size: one per live row plus the values of the drafts that fit; the round takes the size
    with the most per unit of cost."""
    values = draft_values(jnp.asarray([[0.9, 0.8], [0.5, 0.5], [0.1, 0.1]]), jnp.asarray([True, True, False]))
    live = jnp.asarray([True, True, False])  # values: 0.9, 0.72 | 0.5, 0.25; tokens at 2, 3, 4, 6: 2, 2.9, 3.62, 4.37
    assert int(best_size(values, live, ((2, 1.0), (3, 1.2), (4, 1.3), (6, 2.0)))) == 2  # 2.0, 2.42, 2.78, 2.19
    assert int(best_size(values, live, ((2, 1.0), (3, 1.2), (4, 1.9), (6, 2.0)))) == 1  # 2.0, 2.42, 1.91, 2.19
    assert int(best_size(values, live, ((2, 1.0), (3, 1.5), (4, 1.9), (6, 2.2)))) == 0  # 2.0, 1.93, 1.91, 1.99


def test_greedy_output_choosing_the_size_each_round_is_plain_output(tiny, monkeypatch):
    """--verify-budget auto: sizes measured once per setup (here a stand-in for the timing, with costs that make
    rounds choose differently as the drafts' values move) and read from the records after; every row equals plain
    greedy decoding."""
    model, drafter = tiny
    measured = []

    def measure(model, drafter, batch, cache_len, k, budgets, progress=False):
        measured.append(budgets)
        return {"step_seconds": 2.0, "budget_seconds": {b: 2.0 * (1 + 0.05 * (b - batch) ** 1.5) for b in budgets}}

    monkeypatch.setattr(tuner, "measure_budget_costs", measure)
    plain = generate(model, GREEDY_PROMPTS, max_new_tokens=16, batch_size=3, chat=False).token_ids
    records = DecodeRecords()
    for _ in range(2):
        out = generate(model, GREEDY_PROMPTS, max_new_tokens=16, batch_size=3, chat=False, drafter=drafter,
                       draft_len=3, verify_budget="auto", records=records)
        assert out.token_ids == plain
    assert measured == [[3, 5, 6, 9, 12]]
    sizes = out.stats["verify_budget"]["sizes"]
    assert [b for b, _ in sizes] == [3, 5, 6, 9, 12] and sizes[0][1] == 1.0
    assert 1 < out.stats["verified_positions_per_round"] < 4


@pytest.mark.parametrize("argv, says", [
    (["generate", "--verify-budget", "x4"], "expected N, +N (a whole number of positions) or auto, got 'x4'"),
    (["bench", "--verify-budget", "+-1", "--out", "/tmp/never.json"], "expected N, +N"),
])
def test_a_bad_verify_budget_is_one_line(cli_error, argv, says):
    assert says in cli_error(argv[:1] + ["--model", "random:tiny"] + argv[1:])
