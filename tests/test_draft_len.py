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
    good = [0.9, 0.8, 0.7, 0.6]
    cheap = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}  # memory bound: a round costs little more than a step
    s = dl.predicted_speedups(1.0, cheap, good)
    assert s == pytest.approx({1: 1.9 / 1.1, 2: 2.7 / 1.2, 3: 3.4 / 1.3, 4: 4.0 / 1.4})
    assert dl.choose_draft_len(s) == 4
    bound = {k: k + 1.0 for k in range(1, 5)}  # compute bound: a round costs k + 1 steps
    assert dl.choose_draft_len(dl.predicted_speedups(1.0, bound, good)) == 0
    assert dl.choose_draft_len(dl.predicted_speedups(1.0, cheap, [0.0] * 4)) == 0  # useless drafter
    fading = [0.5, 0.1, 0.02, 0.0]  # later slots rarely accepted: fewer drafts are cheaper for the same gain
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

    # New decoding code (an upgrade, an edit) is measured anew: its rounds may cost something else.
    key = dl._cost_key(model, d, 2, 64)
    monkeypatch.setattr(dl, "code_fingerprint", lambda: "other code")
    assert dl._cost_key(model, d, 2, 64) != key


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
