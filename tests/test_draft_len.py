"""--draft-len auto: the cost model's choice, the records it learns from (in memory or on disk), lossless whatever it
picks; the Python API records nothing unless given a store."""

from __future__ import annotations

import json
import types

import jax
import pytest

from specformer_jax.checkpoints.drafter_io import load_drafter, record_eval, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.engine import runner
from specformer_jax.decoding.engine.chunk import run_chunk
from specformer_jax.decoding.tuning import cost_model as cm
from specformer_jax.decoding.tuning import records as rec
from specformer_jax.decoding.tuning import timing, tuner
from specformer_jax.decoding.tuning.draft_len import default_draft_len, default_round
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.tuner import AutoDraftLen, drafter_acceptance
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.loaded import LoadedDrafter

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72]]


def test_speedup_model_and_choice():
    good = cm.expected_tokens([0.9, 0.8, 0.7, 0.6], range(1, 5))
    assert good == pytest.approx({1: 1.9, 2: 2.7, 3: 3.4, 4: 4.0})
    cheap = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}  # memory bound: a round costs little more than a step
    s = cm.predicted_speedups(1.0, cheap, good)
    assert s == pytest.approx({1: 1.9 / 1.1, 2: 2.7 / 1.2, 3: 3.4 / 1.3, 4: 4.0 / 1.4})
    assert cm.choose_draft_len(s) == 4
    bound = {k: k + 1.0 for k in range(1, 5)}  # compute bound: a round costs k + 1 steps
    assert cm.choose_draft_len(cm.predicted_speedups(1.0, bound, good)) == 0
    useless = cm.expected_tokens([0.0] * 4, range(1, 5))
    assert cm.choose_draft_len(cm.predicted_speedups(1.0, cheap, useless)) == 0
    fading = cm.expected_tokens([0.5, 0.1, 0.02, 0.0], range(1, 5))  # later slots rarely accepted: fewer drafts
    assert cm.choose_draft_len(cm.predicted_speedups(1.0, {1: 1.05, 2: 1.2, 3: 1.35, 4: 1.5}, fading)) == 1
    assert cm.choose_draft_len({1: 1.03}) == 0 and cm.choose_draft_len({1: 1.03}, margin=0.0) == 1


def test_the_default_draft_len_follows_the_pool_on_a_cpu(model):
    """Without a draft length: every slot off a CPU; on a CPU with its kernels three drafts at batch 1, two at batch
    2-3, one at 4-5 and plain decoding beyond (as measured: defaults.py; batch 3-4 and 6-8 verify a budget in place
    of these), one without them; generate applies it to the pool it decodes (the pool: the batch size, or fewer
    prompts)."""
    d = drafter(model, None)
    cpu = jax.default_backend() == "cpu"
    packed = [default_draft_len(d, b, True) for b in (1, 2, 3, 4, 5, 8, 64)]  # with the CPU kernels
    assert packed == ([3, 2, 2, 1, 1, 0, 0] if cpu else [3] * 7)
    assert [default_draft_len(d, b, False) for b in (1, 8)] == ([1, 1] if cpu else [3, 3])  # XLA's matmuls
    one = generate(model, PROMPTS[:1], max_new_tokens=8, drafter=d).stats
    assert one["draft_len"] == default_draft_len(d, 1, model.cfg.pack_weights)
    pool = generate(model, PROMPTS * 2, max_new_tokens=8, drafter=d, batch_size=6).stats
    assert (pool["draft_len"], pool["verify_budget"]) == default_round(d, 6, model.cfg.pack_weights)  # a budget
    assert ("mean_accepted_length" in pool) == (pool["draft_len"] > 0)


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"])


def drafter(model, rates):
    cfg = DrafterConfig(num_slots=3)
    meta = {"eval": {"acceptance_rate_per_slot": rates}} if rates else {}
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(0)), meta)


def no_measuring(*a, **k):
    raise AssertionError("costs should come from the records")


@pytest.mark.slow  # CI time: real timing of K + 1 engines; the choices and records are tested on stand-ins below
def test_auto_is_lossless_and_keeps_measured_costs(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())  # to count the loops compiled below
    records = DecodeRecords(tmp_path / "records.json")
    d = drafter(model, [0.9, 0.8, 0.7])
    plain = generate(model, PROMPTS, max_new_tokens=12).token_ids
    capsys.readouterr()
    res = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len="auto", progress=True, records=records)
    assert res.token_ids == plain
    assert "draft-len auto: timing decoding at batch 3" in capsys.readouterr().err  # the slow first use shows
    auto = res.stats["draft_len_auto"]
    assert res.stats["draft_len"] == auto["draft_len"] and 0 <= auto["draft_len"] <= 3
    assert set(auto["round_seconds"]) == {"1", "2", "3"} and auto["step_seconds"] > 0
    assert auto["acceptance_source"] == "teacher_forced" and auto["acceptance"] == [0.9, 0.8, 0.7]
    expected = 1.9 * auto["step_seconds"] / auto["round_seconds"]["1"]  # stats keep 3 decimals of each figure
    assert auto["predicted_speedup"]["1"] == pytest.approx(expected, rel=2e-3, abs=6e-4)
    assert len(json.loads((tmp_path / "records.json").read_text())["step_costs"]) == 1
    # a chunk for each of the k = 0..3 engines timed (timing.py), plus plain decoding above and the chosen k
    assert runner.COMPILED.count(run_chunk) == 1 + 4 + (auto["draft_len"] > 0)

    tuner = AutoDraftLen(records, measure=no_measuring)
    again = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len=tuner, progress=True, records=records)
    assert again.token_ids == plain
    assert "timing decoding" not in capsys.readouterr().err
    second = again.stats["draft_len_auto"]
    assert (second["step_seconds"], second["round_seconds"]) == (auto["step_seconds"], auto["round_seconds"])
    if auto["draft_len"]:  # the first call decoded speculatively: the second uses what it measured
        k = auto["draft_len"]
        measured = res.stats["acceptance_rate_per_slot"]
        assert second["acceptance"][:k] == pytest.approx(measured[:k], abs=1e-4)
        assert second["acceptance_source"] == ("decoding" if k == 3 else "mixed")
        assert second["batch_measured"] == []  # continuous batching: no row waits for a slower one
        assert second["tokens_per_round"][str(k)] == pytest.approx(1 + sum(measured[:k]), abs=1e-4)

    # New decoding code (an upgrade, an edit) is measured anew: its rounds may cost something else.
    key = rec._cost_key(model, d, 2, 64)
    monkeypatch.setattr(rec, "code_fingerprint", lambda: "other code")
    assert rec._cost_key(model, d, 2, 64) != key


def test_each_cost_is_the_median_of_repeats_taken_in_turn(model, monkeypatch):
    """A slow moment of the machine lands on one run; the median of the repeats leaves it out, and the repeats go
    round every k in turn, so a slow stretch does not fall on one k's runs alone."""
    order = []
    slow = {(1, 2)}  # (repeat, k): the run that a busy moment slowed down tenfold

    def fake_run(plan, verify_budget, model, drafter, prompts, budget=None):
        if budget == 2:  # compiling
            return None
        k, repeat = plan.draft_len, sum(1 for o in order if o == plan.draft_len) // 2
        order.append(k)
        rounds = 4 if budget == timing.SHORT_BUDGET else 20
        seconds = rounds * (1.0 + 0.1 * k) * (10 if budget is None and (repeat, k) in slow else 1)
        return types.SimpleNamespace(run_seconds=seconds, rounds_run=rounds)

    monkeypatch.setattr(timing, "_run", fake_run)
    costs = timing.measure_costs(model, drafter(model, None), 2, 64, repeats=3)
    assert costs["step_seconds"] == pytest.approx(1.0)
    assert costs["round_seconds"] == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3})  # the slowed run of k = 2 left out
    assert order == [k for _ in range(3) for k in range(4) for _ in range(2)]  # k = 0..3 in turn, three times


def test_budget_costs_time_each_budget_against_a_plain_step_and_are_kept(model, monkeypatch):
    """--verify-budget auto's timing: a plain step and a round of k drafts under each candidate budget, in turn, taken
    from the same runs as --draft-len auto's; in plain steps, never cheaper than a smaller budget; read from the
    records the second time."""
    runs = []

    def fake_run(plan, verify_budget, model, drafter, prompts, tokens=None):
        runs.append((plan.draft_len, verify_budget, tokens))
        rounds = 4 if tokens == timing.SHORT_BUDGET else 20
        noise = 0.05 if verify_budget == 6 else 0.0  # a busy moment made budget 8 look cheaper than 6
        return types.SimpleNamespace(run_seconds=rounds * (1.0 + 0.01 * verify_budget + noise), rounds_run=rounds)

    monkeypatch.setattr(timing, "_run", fake_run)
    records, d = DecodeRecords(), drafter(model, None)
    budgets = tuner.candidate_budgets(4, 2)
    assert budgets == [4, 6, 8, 12]
    sizes = tuner.measured_sizes(model, d, 4, 64, 2, records)
    assert [b for b, _ in sizes] == [4, 6, 8, 12]
    assert [c for _, c in sizes] == pytest.approx([1.04, 1.11, 1.11, 1.12])
    timed = [r for r in runs if r[2] != 2]  # not the compilations
    assert timed[:4] == [(0, 0, timing.SHORT_BUDGET), (0, 0, None), (2, 4, timing.SHORT_BUDGET), (2, 4, None)]
    assert len(timed) == 2 * 5 * timing.REPEATS
    runs.clear()
    assert tuner.measured_sizes(model, d, 4, 64, 2, records) == sizes and not runs
    assert tuner.candidate_budgets(1, 4) == [1, 2, 3, 5] and tuner.candidate_budgets(8, 1) == [8, 12, 16]


def test_budget_auto_predicts_its_best_size_against_plain_decoding():
    """A size's tokens: every row's one, then its drafts at their slot's mean chance, the likeliest slots first; over
    its cost in plain steps; the best size against the rows a plain step emits. Under the margin: plain decoding."""
    sizes = ((4, 1.1), (6, 1.2), (8, 1.3), (12, 1.7))  # 4 rows, 2 drafts a row: 4 | 2 x 0.6 | 4 x 0.6 | + 4 x 0.3
    assert tuner.predicted_budget_speedup(sizes, 4, [0.6, 0.3, 0.2], 2) == pytest.approx(6.4 / 1.3 / 4)
    assert tuner.predicted_budget_speedup(sizes, 4, [0.9, 0.8], 2) == pytest.approx(10.8 / 1.7 / 4)
    assert not tuner.BudgetChoice(sizes, 1.23).plain and tuner.BudgetChoice(sizes, 1.1).plain
    assert not tuner.BudgetChoice(sizes, None).plain  # nothing to predict with: the sizes, as before
    costly = ((8, 1.18), (12, 1.41), (16, 1.7), (24, 2.12))  # batch 8 with the AVX2 code on a Zen 4 VM
    assert tuner.predicted_budget_speedup(costly, 8, [0.63, 0.38], 2) < 1.0


def test_budget_auto_decodes_plainly_where_no_size_pays(model, monkeypatch):
    """--verify-budget auto at a batch size where every round costs far more than a plain step: plain decoding (the
    drafter not run, no draft verified), its tokens plain decoding's, and the stats say why; where rounds are cheap,
    sizes chosen each round."""
    plain = generate(model, PROMPTS, max_new_tokens=8, batch_size=3).token_ids
    d = drafter(model, [0.6, 0.3, 0.1])
    costs = lambda cost: lambda m, dr, batch, c, k, budgets, progress=False: {  # each position `cost` plain steps
        "step_seconds": 1.0, "budget_seconds": {b: 1.0 + cost * (b - batch + 1) for b in budgets}}
    for cost, is_plain in ((3.0, True), (0.01, False)):
        monkeypatch.setattr(tuner, "measure_budget_costs", costs(cost))
        out = generate(model, PROMPTS, max_new_tokens=8, batch_size=3, drafter=d, draft_len=2, verify_budget="auto")
        assert out.token_ids == plain
        choice = out.stats["verify_budget"]
        assert choice["plain"] is is_plain and (out.stats["draft_len"] == 0) is is_plain
        assert [b for b, _ in choice["sizes"]] == tuner.candidate_budgets(3, 2)
        assert choice["reason"].startswith("plain decoding: the best size is predicted" if is_plain else "a size")
    # --draft-len auto chose k = 3 (rounds as cheap as steps), then the budget decoded plainly: the stats say so
    monkeypatch.setattr(tuner, "measure_budget_costs", costs(3.0))
    cheap = AutoDraftLen(measure=lambda m, dr, batch, c, progress=False: {
        "step_seconds": 1.0, "round_seconds": {1: 1.0, 2: 1.0, 3: 1.0}})
    out = generate(model, PROMPTS, max_new_tokens=8, batch_size=3, drafter=d, draft_len=cheap, verify_budget="auto")
    assert out.token_ids == plain and out.stats["draft_len"] == 0 and out.stats["draft_len_auto"]["draft_len"] == 3
    assert "decoded plainly" in out.stats["draft_len_auto"]["overridden"]


def test_the_api_records_only_into_a_store_it_is_given(model, tmp_path, monkeypatch):
    """A notebook's generate must not change what a later run chooses: without `records` nothing is written (and
    "auto" measures for itself); the CLI keeps its records in SPECFORMER_CACHE."""
    from specformer_jax.cli import main

    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path / "cache"))
    d = drafter(model, [0.9, 0.8, 0.7])
    generate(model, PROMPTS, max_new_tokens=6, drafter=d, draft_len=2)
    measured = []
    tuner = AutoDraftLen(measure=lambda *a, **k: measured.append(a[2]) or {"step_seconds": 1.0,
                                                                           "round_seconds": {1: 1.0, 2: 1.0, 3: 1.0}})
    generate(model, PROMPTS, max_new_tokens=6, drafter=d, draft_len=tuner)
    assert measured == [3] and not (tmp_path / "cache").exists()
    mine = DecodeRecords()  # in memory: this process only
    generate(model, PROMPTS, max_new_tokens=6, drafter=d, draft_len=2, records=mine, schedule="static")
    assert set(mine.batch_rounds(model, d, False, 3)) == {2} and len(mine.acceptance(model, d, False)) == 2
    save_drafter(tmp_path / "d", d.cfg, d.params, model.cfg, dtype="float32", meta=d.meta)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    assert main(["generate", "--model", model.source, "--drafter", str(tmp_path / "d"), "--prompts-file", str(prompts),
                 "--max-new-tokens", "6", "--draft-len", "2", "--schedule", "static"]) == 0
    cli = DecodeRecords(tmp_path / "cache" / rec.FILE_NAME)
    assert set(cli.batch_rounds(model, load_drafter(tmp_path / "d", model), False, 3)) == {2}


def test_damaged_cost_entries_are_measured_again(model, tmp_path):
    d = drafter(model, [0.9, 0.8, 0.7])
    fresh = {"step_seconds": 1.0, "round_seconds": {1: 1.1}}
    path, key = tmp_path / "records.json", rec._cost_key(model, d, 2, 64)
    tuner = AutoDraftLen(DecodeRecords(path), measure=lambda *a, **k: fresh)
    for damaged in ({key: {"step_seconds": 1.0}}, {key: {"step_seconds": "x", "round_seconds": {}}}, {key: [1]}, [1]):
        path.write_text(json.dumps({"step_costs": damaged}))
        assert tuner.choose(model, d, 2, 64).step_seconds == 1.0
        assert json.loads(path.read_text())["step_costs"][key] == {"step_seconds": 1.0, "round_seconds": {"1": 1.1}}
    path.write_text("[1]")
    assert tuner.choose(model, d, 2, 64).round_seconds == {1: 1.1}
    sound = AutoDraftLen(DecodeRecords(path), measure=lambda *a, **k: pytest.fail("a sound entry is reused"))
    assert sound.choose(model, d, 2, 64).round_seconds == {1: 1.1}


def test_decoding_acceptance_is_a_running_average_per_drafter(model, tmp_path):
    d, other = drafter(model, [0.9, 0.8, 0.7]), drafter(model, [0.5, 0.4, 0.3])
    other = LoadedDrafter(other.cfg, init_drafter(model.cfg, other.cfg, jax.random.key(1)), other.meta)
    records = DecodeRecords(tmp_path / "records.json")
    add = lambda dr, rates, rounds, sampled=False: records.add_run(
        model, dr, sampled, batch_size=4, draft_len=len(rates), acceptance=rates, rounds=rounds, plain_steps=0,
        batch_rounds=0)
    assert records.acceptance(model, d, sampled=False) == []
    add(d, [0.5, 0.2], 100)  # two slots drafted
    add(d, [0.2, 0.1, 0.05], 300)
    assert records.acceptance(model, d, sampled=False) == pytest.approx([0.275, 0.125, 0.05])
    assert records.acceptance(model, d, sampled=True) == []  # sampling keeps its own estimate
    assert records.acceptance(model, other, sampled=False) == []  # and so does every other drafter
    add(d, [1.0], 0)  # nothing decoded: nothing learned
    assert records.acceptance(model, d, sampled=False)[0] == pytest.approx(0.275)
    path = tmp_path / "records.json"  # an entry damaged by hand counts as none, and is written anew
    saved = path.read_text()
    key = rec._drafter_key(model, d, False)
    for damaged in ({"accepted": [0.5, "x"], "rounds": [1, 1]}, {"accepted": [0.5]}, [0.5],
                    {"accepted": [2.0], "rounds": [1]}):
        path.write_text(json.dumps({"acceptance": {key: damaged}}))
        assert records.acceptance(model, d, sampled=False) == []
    path.write_text("[1]")
    assert records.acceptance(model, d, sampled=False) == []
    add(d, [0.4], 10)
    assert records.acceptance(model, d, sampled=False) == pytest.approx([0.4])
    path.write_text(saved)
    # a useless drafter, once measured, makes auto fall back to plain decoding whatever its eval promised
    costs = {"step_seconds": 1.0, "round_seconds": {1: 1.02, 2: 1.05, 3: 1.1}}
    tuner = AutoDraftLen(records, measure=lambda *a, **k: costs)
    assert tuner.choose(model, d, 4, 64).draft_len > 0  # measured 0.275 + 0.125 + 0.05: still worth it
    add(other, [0.01, 0.0, 0.0], 500)
    choice = tuner.choose(model, other, 4, 64)
    assert (choice.draft_len, choice.acceptance_source) == (0, "decoding")


def test_auto_needs_recorded_acceptance(model, tmp_path, cli_error):
    with pytest.raises(SpecformerError, match="eval-drafter"):
        generate(model, PROMPTS, max_new_tokens=4, drafter=drafter(model, None), draft_len="auto")
    d = drafter(model, None)
    save_drafter(tmp_path / "d", d.cfg, d.params, model.cfg)
    record_eval(tmp_path / "d", {"acceptance_rate_per_slot": [0.5, 0.25, 0.1]})
    assert drafter_acceptance(load_drafter(tmp_path / "d", model)) == [0.5, 0.25, 0.1]
    err = cli_error(["generate", "--model", "x", "--prompt", "hi", "--draft-len", "often"])
    assert "non-negative integer or auto" in err


def test_tokens_per_round_follow_what_batches_achieved():
    expected = {1: 1.5, 2: 1.8, 3: 2.0}
    assert cm.tokens_per_round(expected, {}) == expected
    assert cm.tokens_per_round(expected, {4: {"steps": 10, "rounds": 10}}) == expected  # a k not asked about
    # k = 2 measured at 1.35 tokens per round, 75% of its E: the others are scaled alike
    got = cm.tokens_per_round(expected, {2: {"steps": 135, "rounds": 100}})
    assert got == pytest.approx({1: 1.125, 2: 1.35, 3: 1.5})
    # several measured k: each keeps its own figure, the share for the rest is over all their rounds
    got = cm.tokens_per_round(expected, {1: {"steps": 150, "rounds": 100}, 2: {"steps": 90, "rounds": 100}})
    assert got == pytest.approx({1: 1.5, 2: 0.9, 3: 2.0 * 240 / 330})
    # batches that beat E keep their own figure, and the others keep E
    assert cm.tokens_per_round(expected, {2: {"steps": 200, "rounds": 100}}) == pytest.approx({1: 1.5, 2: 2.0, 3: 2.0})


def test_batches_that_did_not_pay_turn_auto_off(model, tmp_path):
    """A static batch waits for its slowest row: when decoding at a batch size needed nearly as many rounds as plain
    steps, auto stops drafting there (on the static schedule) although the drafter's acceptance promises a
    speedup."""
    d = drafter(model, [0.5, 0.3, 0.1])
    path = tmp_path / "records.json"
    records = DecodeRecords(path)
    costs = {"step_seconds": 1.0, "round_seconds": {1: 1.1, 2: 1.2, 3: 1.3}}
    tuner = AutoDraftLen(records, measure=lambda *a, **k: costs)
    first = tuner.choose(model, d, 8, 64, schedule="static")
    assert first.draft_len == 2 and first.batch_measured == []  # E = 1.8 for 1.2 steps' time: 1.5x
    # What generate records: plain decoding's steps for the same tokens (the longest row's, less the prefill's token)
    # against the rounds run. A real run at batch 3 on the tiny model:
    spec = generate(model, PROMPTS, max_new_tokens=12, drafter=d, draft_len=2, records=records, schedule="static")
    plain = generate(model, PROMPTS, max_new_tokens=12, schedule="static")
    assert spec.token_ids == plain.token_ids
    stored = records.batch_rounds(model, d, False, 3)
    assert stored == {2: {"steps": plain.stats["decode_steps"], "rounds": spec.stats["decode_steps"]}}
    ratio = plain.stats["decode_steps"] / spec.stats["decode_steps"]
    assert spec.stats["batch_accepted_length"] == pytest.approx(ratio)
    assert records.batch_rounds(model, d, False, 8) == {}  # other batch sizes keep their own
    add = lambda b, k, steps, rounds: records.add_run(model, d, False, batch_size=b, draft_len=k, acceptance=[],
                                                      rounds=0, plain_steps=steps, batch_rounds=rounds)
    tables = json.loads(path.read_text())  # entries damaged by hand are ignored
    for entries in tables["batch_rounds"].values():
        entries.update({"8": {"steps": 1, "rounds": 1}, "8,x": {}, "8,1": {"steps": "many", "rounds": 3}})
    path.write_text(json.dumps(tables))
    assert records.batch_rounds(model, d, False, 8) == {}
    add(8, 1, 12, 10)  # recorded afresh
    assert records.batch_rounds(model, d, False, 8) == {1: {"steps": 12, "rounds": 10}}
    for damaged in ([1], {"batch_rounds": [1]}, {"batch_rounds": {key: [1] for key in tables["batch_rounds"]}}):
        path.write_text(json.dumps(damaged))  # not objects at all
        assert records.batch_rounds(model, d, False, 3) == {}
        add(3, 2, 12, 10)
        assert records.batch_rounds(model, d, False, 3) == {2: {"steps": 12, "rounds": 10}}
    # At batch 8, k = 2 gave 1.1 tokens a round (61% of E): every k now predicts below 1.15x, so plain decoding.
    add(8, 2, 110, 100)
    second = tuner.choose(model, d, 8, 64, schedule="static")
    assert second.batch_measured == [2] and second.tokens_per_round[2] == pytest.approx(1.1)
    assert second.draft_len == 0 and max(second.predicted_speedup.values()) < 1.15
    best = max(second.predicted_speedup, key=second.predicted_speedup.get)  # the stats say why: plain decoding
    assert second.to_json()["reason"] == (f"plain decoding: no draft length is predicted to beat it by 15% (the best, "
                                          f"k = {best}, {second.predicted_speedup[best]:.2f}x)")
    assert first.to_json()["reason"] == f"k = 2: predicted {first.predicted_speedup[2]:.2f}x plain decoding"
    assert tuner.choose(model, d, 8, 64, sampled=True, schedule="static").draft_len == 2  # sampling: its own record
    assert tuner.choose(model, d, 8, 64).draft_len == 2  # continuous batching: rows do not wait for slower ones
    # a long good stretch afterwards brings drafting back (older runs count up to MAX_REMEMBERED_ROUNDS rounds)
    add(8, 2, 170_000, 100_000)
    add(8, 2, 170_000, 100_000)
    third = tuner.choose(model, d, 8, 64, schedule="static")
    keep = rec.MAX_REMEMBERED_ROUNDS / 100_100
    assert third.tokens_per_round[2] == pytest.approx((170_110 * keep + 170_000) / (100_100 * keep + 100_000))
    assert third.draft_len > 0
