"""--draft-len auto: the cost model's choice, measured costs cached on disk, lossless whatever it picks."""

from __future__ import annotations

import json

import jax
import pytest

from specformer_jax.checkpoints.drafter_io import LoadedDrafter, load_drafter, record_eval, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding import api, draft_len as dl
from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72]]


def test_speedup_model_and_choice():
    good = dl.expected_tokens([0.9, 0.8, 0.7, 0.6], range(1, 5))
    assert good == pytest.approx({1: 1.9, 2: 2.7, 3: 3.4, 4: 4.0})
    cheap = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}  # memory bound: a round costs little more than a step
    s = dl.predicted_speedups(1.0, cheap, good)
    assert s == pytest.approx({1: 1.9 / 1.1, 2: 2.7 / 1.2, 3: 3.4 / 1.3, 4: 4.0 / 1.4})
    assert dl.choose_draft_len(s) == 4
    bound = {k: k + 1.0 for k in range(1, 5)}  # compute bound: a round costs k + 1 steps
    assert dl.choose_draft_len(dl.predicted_speedups(1.0, bound, good)) == 0
    useless = dl.expected_tokens([0.0] * 4, range(1, 5))
    assert dl.choose_draft_len(dl.predicted_speedups(1.0, cheap, useless)) == 0
    fading = dl.expected_tokens([0.5, 0.1, 0.02, 0.0], range(1, 5))  # later slots rarely accepted: fewer drafts
    assert dl.choose_draft_len(dl.predicted_speedups(1.0, {1: 1.05, 2: 1.2, 3: 1.35, 4: 1.5}, fading)) == 1
    assert dl.choose_draft_len({1: 1.03}) == 0 and dl.choose_draft_len({1: 1.03}, margin=0.0) == 1


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"])


def drafter(model, rates):
    cfg = DrafterConfig(num_slots=3)
    meta = {"eval": {"acceptance_rate_per_slot": rates}} if rates else {}
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(0)), meta)


def test_auto_is_lossless_and_caches_measured_costs(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(api, "_COMPILED", api._Compiled())  # to count the loops compiled below
    d = drafter(model, [0.9, 0.8, 0.7])
    plain = generate(model, PROMPTS, max_new_tokens=12).token_ids
    capsys.readouterr()
    res = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len="auto", progress=True)
    assert res.token_ids == plain
    assert "draft-len auto: timing decode loops at batch 3" in capsys.readouterr().err  # the slow first use shows
    auto = res.stats["draft_len_auto"]
    assert res.stats["draft_len"] == auto["draft_len"] and 0 <= auto["draft_len"] <= 3
    assert set(auto["round_seconds"]) == {"1", "2", "3"} and auto["step_seconds"] > 0
    assert auto["acceptance_source"] == "teacher_forced" and auto["acceptance"] == [0.9, 0.8, 0.7]
    assert auto["predicted_speedup"]["1"] == pytest.approx(1.9 * auto["step_seconds"] / auto["round_seconds"]["1"],
                                                           rel=1e-3)
    assert len(json.loads((tmp_path / "step_costs.json").read_text())) == 1
    # each of the k = 0..3 loops timed was compiled once (by compile_loops), plus plain decoding above and the chosen k
    assert len(api._COMPILED._cache) == 1 + 4 + (auto["draft_len"] > 0)

    def no_measuring(*a, **k):
        raise AssertionError("costs should come from the cache")

    monkeypatch.setattr(dl, "measure_costs", no_measuring)
    again = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len="auto", progress=True)
    assert again.token_ids == plain
    assert "timing decode loops" not in capsys.readouterr().err
    second = again.stats["draft_len_auto"]
    assert (second["step_seconds"], second["round_seconds"]) == (auto["step_seconds"], auto["round_seconds"])
    if auto["draft_len"]:  # the first call decoded speculatively: the second uses what it measured
        k = auto["draft_len"]
        measured = res.stats["acceptance_rate_per_slot"]
        assert second["acceptance"][:k] == pytest.approx(measured[:k], abs=1e-4)
        assert second["acceptance_source"] == ("decoding" if k == 3 else "mixed")
        assert second["batch_measured"] == [k]
        assert second["tokens_per_round"][str(k)] == pytest.approx(res.stats["batch_accepted_length"], abs=1e-4)

    # New decoding code (an upgrade, an edit) is measured anew: its rounds may cost something else.
    key = dl._cost_key(model, d, 2, 64)
    monkeypatch.setattr(dl, "code_fingerprint", lambda: "other code")
    assert dl._cost_key(model, d, 2, 64) != key


def test_damaged_cost_entries_are_measured_again(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    d = drafter(model, [0.9, 0.8, 0.7])
    fresh = {"step_seconds": 1.0, "round_seconds": {1: 1.1}}
    monkeypatch.setattr(dl, "measure_costs", lambda *a, **k: fresh)
    path, key = tmp_path / "step_costs.json", dl._cost_key(model, d, 2, 64)
    for damaged in ({key: {"step_seconds": 1.0}}, {key: {"step_seconds": "x", "round_seconds": {}}}, {key: [1]}, [1]):
        path.write_text(json.dumps(damaged))
        assert dl.measured_costs(model, d, 2, 64) == fresh
        assert json.loads(path.read_text())[key] == {"step_seconds": 1.0, "round_seconds": {"1": 1.1}}
    monkeypatch.setattr(dl, "measure_costs", lambda *a, **k: pytest.fail("a sound entry is reused"))
    assert dl.measured_costs(model, d, 2, 64) == fresh


def test_decoding_acceptance_is_a_running_average_per_drafter(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    d, other = drafter(model, [0.9, 0.8, 0.7]), drafter(model, [0.5, 0.4, 0.3])
    other = LoadedDrafter(other.cfg, init_drafter(model.cfg, other.cfg, jax.random.key(1)), other.meta)
    assert dl.decoding_acceptance(model, d, sampled=False) == []
    dl.remember_acceptance(model, d, [0.5, 0.2], rounds=100, sampled=False)  # two slots drafted
    dl.remember_acceptance(model, d, [0.2, 0.1, 0.05], rounds=300, sampled=False)
    assert dl.decoding_acceptance(model, d, sampled=False) == pytest.approx([0.275, 0.125, 0.05])
    assert dl.decoding_acceptance(model, d, sampled=True) == []  # sampling keeps its own estimate
    assert dl.decoding_acceptance(model, other, sampled=False) == []  # and so does every other drafter
    dl.remember_acceptance(model, d, [1.0], rounds=0, sampled=False)  # nothing decoded: nothing learned
    assert dl.decoding_acceptance(model, d, sampled=False)[0] == pytest.approx(0.275)
    path = tmp_path / "decode_acceptance.json"  # an entry damaged by hand counts as none, and is written anew
    saved = path.read_text()
    key = dl._drafter_key(model, d, False)
    for damaged in ({"rates": [0.5, "x"], "rounds": [1, 1]}, {"rates": [0.5]}, [0.5], {"rates": [2.0], "rounds": [1]}):
        path.write_text(json.dumps({key: damaged}))
        assert dl.decoding_acceptance(model, d, sampled=False) == []
    path.write_text("[1]")
    assert dl.decoding_acceptance(model, d, sampled=False) == []
    dl.remember_acceptance(model, d, [0.4], rounds=10, sampled=False)
    assert dl.decoding_acceptance(model, d, sampled=False) == pytest.approx([0.4])
    path.write_text(saved)
    # a useless drafter, once measured, makes auto fall back to plain decoding whatever its eval promised
    monkeypatch.setattr(dl, "measured_costs", lambda *a: {"step_seconds": 1.0, "round_seconds": {1: 1.02, 2: 1.05, 3: 1.1}})
    assert dl.auto_draft_len(model, d, 4, 64).draft_len > 0  # measured 0.275 + 0.125 + 0.05: still worth it
    dl.remember_acceptance(model, other, [0.01, 0.0, 0.0], rounds=500, sampled=False)
    choice = dl.auto_draft_len(model, other, 4, 64)
    assert (choice.draft_len, choice.acceptance_source) == (0, "decoding")


def test_auto_needs_recorded_acceptance(model, tmp_path, cli_error):
    with pytest.raises(SpecformerError, match="eval-drafter"):
        generate(model, PROMPTS, max_new_tokens=4, drafter=drafter(model, None), draft_len="auto")
    d = drafter(model, None)
    save_drafter(tmp_path / "d", d.cfg, d.params, model.cfg)
    record_eval(tmp_path / "d", {"acceptance_rate_per_slot": [0.5, 0.25, 0.1]})
    assert dl.drafter_acceptance(load_drafter(tmp_path / "d", model)) == [0.5, 0.25, 0.1]
    err = cli_error(["generate", "--model", "x", "--prompt", "hi", "--draft-len", "often"])
    assert "non-negative integer or auto" in err


def test_tokens_per_round_follow_what_batches_achieved():
    expected = {1: 1.5, 2: 1.8, 3: 2.0}
    assert dl.tokens_per_round(expected, {}) == expected
    assert dl.tokens_per_round(expected, {4: {"steps": 10, "rounds": 10}}) == expected  # a k not asked about
    # k = 2 measured at 1.35 tokens per round, 75% of its E: the others are scaled alike
    got = dl.tokens_per_round(expected, {2: {"steps": 135, "rounds": 100}})
    assert got == pytest.approx({1: 1.125, 2: 1.35, 3: 1.5})
    # several measured k: each keeps its own figure, the share for the rest is over all their rounds
    got = dl.tokens_per_round(expected, {1: {"steps": 150, "rounds": 100}, 2: {"steps": 90, "rounds": 100}})
    assert got == pytest.approx({1: 1.5, 2: 0.9, 3: 2.0 * 240 / 330})
    # batches that beat E keep their own figure, and the others keep E
    assert dl.tokens_per_round(expected, {2: {"steps": 200, "rounds": 100}}) == pytest.approx({1: 1.5, 2: 2.0, 3: 2.0})


def test_batches_that_did_not_pay_turn_auto_off(model, tmp_path, monkeypatch):
    """A batch waits for its slowest row: when decoding at a batch size needed nearly as many rounds as plain steps,
    auto stops drafting there although the drafter's acceptance promises a speedup."""
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    d = drafter(model, [0.5, 0.3, 0.1])
    costs = {"step_seconds": 1.0, "round_seconds": {1: 1.1, 2: 1.2, 3: 1.3}}
    monkeypatch.setattr(dl, "measured_costs", lambda *a: costs)
    first = dl.auto_draft_len(model, d, 8, 64)
    assert first.draft_len == 2 and first.batch_measured == []  # E = 1.8 for 1.2 steps' time: 1.5x
    # What generate records: plain decoding's steps for the same tokens (the longest row's, less the prefill's token)
    # against the rounds run. A real run at batch 3 on the tiny model:
    spec = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len=2)
    plain = generate(model, PROMPTS, max_new_tokens=12)
    assert spec.token_ids == plain.token_ids
    stored = dl.batch_rounds(model, d, 3, sampled=False)
    assert stored == {2: {"steps": plain.stats["decode_steps"], "rounds": spec.stats["decode_steps"]}}
    ratio = plain.stats["decode_steps"] / spec.stats["decode_steps"]
    assert spec.stats["batch_accepted_length"] == pytest.approx(ratio)
    assert dl.batch_rounds(model, d, 8, sampled=False) == {}  # other batch sizes keep their own
    path = tmp_path / "batch_rounds.json"  # entries damaged by hand are ignored
    table = json.loads(path.read_text())
    for entries in table.values():
        entries.update({"8": {"steps": 1, "rounds": 1}, "8,x": {}, "8,1": {"steps": "many", "rounds": 3}})
    path.write_text(json.dumps(table))
    assert dl.batch_rounds(model, d, 8, sampled=False) == {}
    dl.remember_batch_rounds(model, d, 8, 1, plain_steps=12, rounds=10, sampled=False)  # recorded afresh
    assert dl.batch_rounds(model, d, 8, sampled=False) == {1: {"steps": 12, "rounds": 10}}
    for damaged in ([1], {key: [1] for key in table}):  # not objects at all
        path.write_text(json.dumps(damaged))
        assert dl.batch_rounds(model, d, 3, sampled=False) == {}
        dl.remember_batch_rounds(model, d, 3, 2, plain_steps=12, rounds=10, sampled=False)
        assert dl.batch_rounds(model, d, 3, sampled=False) == {2: {"steps": 12, "rounds": 10}}
    # At batch 8, k = 2 gave 1.1 tokens a round (61% of E): every k now predicts below 1.15x, so plain decoding.
    dl.remember_batch_rounds(model, d, 8, 2, plain_steps=110, rounds=100, sampled=False)
    second = dl.auto_draft_len(model, d, 8, 64)
    assert second.batch_measured == [2] and second.tokens_per_round[2] == pytest.approx(1.1)
    assert second.draft_len == 0 and max(second.predicted_speedup.values()) < 1.15
    assert dl.auto_draft_len(model, d, 8, 64, sampled=True).draft_len == 2  # sampling keeps its own record
    # a long good stretch afterwards brings drafting back (older runs count up to MAX_REMEMBERED_ROUNDS rounds)
    dl.remember_batch_rounds(model, d, 8, 2, plain_steps=170_000, rounds=100_000, sampled=False)
    dl.remember_batch_rounds(model, d, 8, 2, plain_steps=170_000, rounds=100_000, sampled=False)
    third = dl.auto_draft_len(model, d, 8, 64)
    keep = dl.MAX_REMEMBERED_ROUNDS / 100_100
    assert third.tokens_per_round[2] == pytest.approx((170_110 * keep + 170_000) / (100_100 * keep + 100_000))
    assert third.draft_len > 0
