"""The drafter's calibration: what eval-drafter measures (confidence bins per slot, given the slots before it), the
monotone fit decoding reads, and the table read on the device against numpy's interpolation."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.kinds import draft_source
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.modeling import calibration
from specformer_jax.training.evaluate import evaluate_drafter


def test_the_monotone_fit_is_the_closest_non_decreasing_sequence():
    """Pool-adjacent-violators against a brute-force search over a grid of non-decreasing sequences."""
    np.testing.assert_allclose(calibration.monotone(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4)), [1, 2.5, 2.5, 4])
    np.testing.assert_allclose(calibration.monotone(np.array([0.2, 0.5, 0.9]), np.ones(3)), [0.2, 0.5, 0.9])
    rng = np.random.default_rng(0)
    grid = np.linspace(0, 1, 21)
    for _ in range(5):
        y, w = rng.random(4), rng.integers(1, 10, 4).astype(float)
        fit = calibration.monotone(y, w)
        assert np.all(np.diff(fit) >= -1e-12)
        best = min((c for c in itertools.product(grid, repeat=4) if np.all(np.diff(c) >= 0)),
                   key=lambda c: np.sum(w * (np.asarray(c) - y) ** 2))
        assert np.sum(w * (fit - y) ** 2) <= np.sum(w * (np.asarray(best) - y) ** 2) + 1e-12


def test_the_table_is_the_fit_read_on_the_grid_and_decoding_interpolates_it():
    bins = {"count": [[0] * 18 + [10, 30], [4] * 20], "accepted": [[0] * 18 + [9, 24], [1] * 20],
            "confidence_sum": [[0] * 18 + [9.2, 29.1], [4 * (i + 0.5) / 20 for i in range(20)]]}
    table = calibration.fit_table(bins)
    assert table.shape == (2, calibration.GRID)
    # slot 0: two bins, 0.92 -> 0.9 and 0.97 -> 0.8 violate monotonicity and pool to 33/40
    np.testing.assert_allclose(table[0], np.full(calibration.GRID, 33 / 40), rtol=1e-6)
    np.testing.assert_allclose(table[1], np.full(calibration.GRID, 0.25), rtol=1e-6)
    rng = np.random.default_rng(1)
    table = np.sort(rng.random((3, calibration.GRID)), axis=1).astype(np.float32)
    conf = rng.random((5, 3)).astype(np.float32)
    got = calibration.calibrated(jnp.asarray(conf), jnp.asarray(table))
    grid = np.linspace(0, 1, calibration.GRID)
    want = np.stack([np.interp(conf[:, i], grid, table[i]) for i in range(3)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(calibration.calibrated(jnp.asarray(conf), None), conf)


@pytest.fixture(scope="module")
def tiny():
    model = load_target("random:tiny", dtype="float32")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=rng.integers(4, 12)).tolist() for _ in range(12)]
    answers = generate(model, prompts, max_new_tokens=24, batch_size=12, chat=False).token_ids
    records = [{"index": i, "input_ids": p + a, "prompt_len": len(p)} for i, (p, a) in enumerate(zip(prompts, answers))]
    return model, resolve_drafter("random", model), records


def test_eval_counts_each_slot_given_the_slots_before_it(tiny):
    """The bins' totals are the eval's own counts: slot 1 is reached at every scored position, slot i + 1 where the
    first i were accepted; its accepted are the positions accepting i + 1. Each bin's confidences lie in the bin."""
    model, drafter, records = tiny
    result = evaluate_drafter(model, drafter, records, seq_len=40, batch_size=4)
    bins, K = result["calibration"], drafter.cfg.num_slots
    count, accepted = np.asarray(bins["count"]), np.asarray(bins["accepted"])
    at_least = np.asarray(result["acceptance_rate_per_slot"]) * result["scored_positions"]
    np.testing.assert_allclose(count.sum(1), np.concatenate([[result["scored_positions"]], at_least[:-1]]), atol=0.1)
    np.testing.assert_allclose(accepted.sum(1), at_least, atol=0.1)
    assert count.shape == (K, calibration.BINS) and np.all(accepted <= count)
    mean = np.asarray(bins["confidence_sum"])[count > 0] / count[count > 0]
    low = np.nonzero(count > 0)[1] / calibration.BINS
    assert np.all((mean >= low - 1e-3) & (mean <= low + 1 / calibration.BINS + 1e-3))
    assert len(result["calibration_error_per_slot"]) == K


def test_a_drafter_with_a_measured_calibration_drafts_with_its_table(tiny):
    """The eval stored in the drafter's meta (what --save writes) gives the draft source its fitted table; a drafter
    without one ranks by its confidences as they are."""
    model, drafter, records = tiny
    assert draft_source(drafter, None, model.cfg, None).calibration is None
    result = evaluate_drafter(model, drafter, records, seq_len=40, batch_size=4)
    measured = dataclasses.replace(drafter, meta={**drafter.meta, "eval": result})
    table = draft_source(measured, None, model.cfg, None).calibration
    np.testing.assert_allclose(table, calibration.fit_table(result["calibration"]))
    assert np.all(np.diff(np.asarray(table), axis=1) >= -1e-7)
