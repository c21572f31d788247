"""Drafter training: the loss goes down, interrupted or crashed runs resume to the same parameters, configs and the
exported drafter are validated."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import DrafterParams
from specformer_jax.modeling.loaded import LoadedDrafter
from specformer_jax.training import trainer
from specformer_jax.training.data.dataset import load_records, read_distilled
from specformer_jax.training.data.distill import distill
from specformer_jax.training.evaluate import evaluate_drafter
from specformer_jax.training.train_config import TrainConfig, load_train_config


@pytest.fixture(scope="module")
def records(tiny_checkpoints):
    """Self-distilled records from the tiny Llama: random prompts, the target's own greedy answers."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=rng.integers(4, 12)).tolist() for _ in range(40)]
    model = load_target(tiny_checkpoints["llama3"])
    answers = generate(model, prompts, max_new_tokens=24, batch_size=20).token_ids
    return [{"index": i, "input_ids": p + a, "prompt_len": len(p)} for i, (p, a) in enumerate(zip(prompts, answers))]


def config(tiny_checkpoints, tmp_path, **kw):
    base = dict(model=str(tiny_checkpoints["llama3"]), data="unused", out=str(tmp_path), seq_len=40, batch_size=8,
                num_slots=3, steps=6, lr=3e-3, adam_eps=1e-8, log_every=1, eval_every=3, eval_batches=1, save_every=2,
                eval_fraction=0.1, chunk_positions=64)
    return TrainConfig.from_settings({**base, **kw})


def metrics(out, split="train"):
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["split"] == split]


@pytest.mark.parametrize("objective, extra", [
    pytest.param("ce", {}, id="ce"), pytest.param("kl", {}, marks=pytest.mark.slow, id="kl"),
    pytest.param("ce", {"slot_loss_reach": True}, marks=pytest.mark.slow, id="ce-reach"),
    pytest.param("ce", {"context_token_input": True}, marks=pytest.mark.slow, id="ce-context")])
def test_loss_decreases_in_a_few_steps(tiny_checkpoints, tmp_path, use_records, objective, extra):
    trainer.train(config(tiny_checkpoints, tmp_path, steps=40, eval_every=40, save_every=40, objective=objective,
                         **extra), progress=False)
    train = metrics(tmp_path)
    losses = [np.mean(m["loss_per_slot"]) for m in train]  # unweighted: a reach-weighted loss may rise as it learns
    assert len(losses) == 40
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3])
    assert np.mean([m["accuracy_per_slot"][0] for m in train[-5:]]) > np.mean([m["accuracy_per_slot"][0]
                                                                               for m in train[:3]]) + 0.05
    ev = metrics(tmp_path, "eval")[-1]
    assert len(ev["accuracy_per_slot"]) == 3 and ev["expected_accepted_length"] >= 1.0
    assert (tmp_path / "drafter" / "params.safetensors").is_file()
    if "context_token_input" in extra:  # the exported drafter keeps the input and loads with it
        loaded = load_drafter(tmp_path / "drafter", load_target(tiny_checkpoints["llama3"]))
        assert loaded.cfg.context_token_input and loaded.params.weights["fuse"]["kernel"].shape[0] == 5 * 64


@pytest.mark.slow  # CI time: eval-drafter is checked against the logged eval
def test_eval_data_is_what_periodic_eval_scores(tiny_checkpoints, tmp_path, records, monkeypatch):
    model = load_target(tiny_checkpoints["llama3"])
    unseen = [list(range(5 + i, 12 + 2 * i)) for i in range(8)]  # prompts the training records do not have
    distill(model, unseen, tmp_path / "unseen", max_new_tokens=24, batch_size=8, progress=False, purpose="eval")
    monkeypatch.setattr(trainer, "load_records",
                        lambda d, setting="data", for_training=True: records if for_training else load_records(
                            d, setting, False))
    monkeypatch.setattr(trainer, "check_vocabulary", lambda *a: None)  # training records in memory: no manifest
    cfg = config(tiny_checkpoints, tmp_path / "run", steps=4, eval_every=4, eval_data=str(tmp_path / "unseen"))
    params = trainer.train(cfg, progress=False)["state"].params
    logged = metrics(tmp_path / "run", "eval")[-1]
    drafter = dataclasses.replace(load_drafter(tmp_path / "run" / "drafter", model), params=DrafterParams(params))
    want = evaluate_drafter(model, drafter, read_distilled(tmp_path / "unseen"), seq_len=cfg.seq_len,
                            batch_size=cfg.batch_size)
    np.testing.assert_allclose(logged["accuracy_per_slot"], want["accuracy_per_slot"], atol=1e-4)
    np.testing.assert_allclose(logged["expected_accepted_length"], want["expected_accepted_length"], atol=1e-4)


class _FailingIterator:
    """Wraps the grain iterator and raises on the n-th batch: a stand-in for Ctrl-C or a crash mid-run."""

    def __init__(self, inner, fail_at: int, exc):
        self.inner, self.fail_at, self.exc, self.calls = inner, fail_at, exc, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.exc
        return next(self.inner)

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, s):
        self.inner.set_state(s)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(),
                                 pytest.param(RuntimeError("node lost"), marks=pytest.mark.slow)])
def test_interrupted_run_resumes_to_identical_parameters(tiny_checkpoints, tmp_path, use_records, monkeypatch, exc):
    full = trainer.train(config(tiny_checkpoints, tmp_path / "full"), progress=False)["state"].params
    real = trainer.training_batches
    monkeypatch.setattr(trainer, "training_batches", lambda *a, **k: _FailingIterator(iter(real(*a, **k)), 6, exc))
    cfg = config(tiny_checkpoints, tmp_path / "cut")
    with pytest.raises((SpecformerError, RuntimeError)):
        trainer.train(cfg, progress=False)  # dies fetching batch 6; a checkpoint at step 5 (Ctrl-C) or 4 (crash)
    # drawn at the step-3 eval
    assert (tmp_path / "cut" / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setattr(trainer, "training_batches", real)
    with pytest.raises(SpecformerError, match="--resume"):
        trainer.train(cfg, progress=False)  # refuses to overwrite
    resumed = trainer.train(cfg, resume=True, progress=False)["state"].params
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_eval_cut_by_ctrl_c_runs_again_on_resume(tiny_checkpoints, tmp_path, use_records, monkeypatch):
    real, calls = trainer.make_steps, []

    def stopped_in_second_eval(*args, **kwargs):
        train_step, eval_step = real(*args, **kwargs)

        def eval_then_ctrl_c(*a):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return eval_step(*a)

        return train_step, eval_then_ctrl_c

    monkeypatch.setattr(trainer, "make_steps", stopped_in_second_eval)
    cfg = config(tiny_checkpoints, tmp_path, steps=6)  # evals at steps 3 and 6
    with pytest.raises(SpecformerError, match="interrupted; checkpoint at step 6"):
        trainer.train(cfg, progress=False)
    monkeypatch.setattr(trainer, "make_steps", real)
    trainer.train(cfg, resume=True, progress=False)
    assert [m["step"] for m in metrics(tmp_path, "eval")] == [3, 6]  # the last eval was lost, and with it the
    recorded = json.loads((tmp_path / "drafter" / "drafter.json").read_text())["eval"]  # drafter's record of it
    assert recorded["acceptance_rate_per_slot"] == metrics(tmp_path, "eval")[-1]["acceptance_rate_per_slot"]


def test_train_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(SpecformerError, match="not valid YAML"):
        load_train_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("steps: 10\nlr: 1\n")
    assert load_train_config(good, ["batch_size=4"]) == TrainConfig(steps=10, lr=1.0, batch_size=4)
    assert load_train_config(good, ["lr=3e-4"]).lr == 3e-4  # YAML 1.1 reads 3e-4 as a string, as `--help` shows it
    with pytest.raises(SpecformerError, match="lr must be a positive finite number"):
        load_train_config(good, ["lr=fast"])
    sci = tmp_path / "sci.yaml"
    sci.write_text("lr: 5e-4\n")  # the same in a config file
    assert load_train_config(sci, []).lr == 5e-4
    with pytest.raises(SpecformerError, match="unknown setting"):
        load_train_config(good, ["stepz=3"])
    with pytest.raises(SpecformerError, match="steps must be a positive integer"):
        load_train_config(good, ["steps=many"])
    with pytest.raises(SpecformerError, match="does not exist"):
        load_train_config(tmp_path / "nope.yaml")
    with pytest.raises(SpecformerError, match="is not a file"):
        load_train_config(tmp_path)
    with pytest.raises(SpecformerError, match="objective must be one of ce, kl"):
        load_train_config(good, ["objective=mse"])
    with pytest.raises(SpecformerError, match="intermediate_size must be a positive integer"):
        load_train_config(good, ["intermediate_size=0"])
    assert load_train_config(good, ["intermediate_size=96"]).drafter.intermediate_size == 96
    assert load_train_config(good, ["slot_loss_reach=true"]).slot_loss_reach is True
    for setting, message in [("lr=.nan", "lr must be a positive finite number"), ("lr=-1", "lr must be"),
                             ("adam_eps=0", "adam_eps must be"), ("grad_clip=-1", "grad_clip must be"),
                             ("warmup_frac=5", r"warmup_frac must be a finite number in \[0, 1\]"),
                             ("min_lr=2", "min_lr must be"), ("weight_decay=.inf", "weight_decay must be"),
                             ("chunk_positions=0", "chunk_positions must be a positive integer"),
                             ("lr=[", "not valid YAML"),
                             ("hooks=[a,b]", "hooks must be a list of integers"),
                             ("slot_loss_reach=maybe", "slot_loss_reach must be true or false")]:
        with pytest.raises(SpecformerError, match=message):
            load_train_config(good, [setting])


def test_training_and_eval_refuse_misuse_from_python(tiny_checkpoints, tmp_path, records, use_records):
    with pytest.raises(SpecformerError, match="steps must be a positive integer"):
        config(tiny_checkpoints, tmp_path, steps=2.5)
    with pytest.raises(SpecformerError, match="cfg must be a TrainConfig"):
        trainer.train({"steps": 2})
    with pytest.raises(SpecformerError, match="seq_len 3 leaves no answer token"):  # prompts are 4 to 11 tokens
        trainer.train(config(tiny_checkpoints, tmp_path, seq_len=3), progress=False)
    target = load_target(tiny_checkpoints["llama3"])
    drafter = LoadedDrafter(DrafterConfig(num_slots=3), DrafterParams(
        trainer.initial_params(config(tiny_checkpoints, tmp_path), target)), {})
    with pytest.raises(SpecformerError, match="non-empty list of distilled records"):
        evaluate_drafter(target, drafter, [])
    bad = [{**records[0], "input_ids": records[0]["input_ids"] + [500]}]
    with pytest.raises(SpecformerError, match="token id 500 is outside"):  # was scored as NaN losses
        evaluate_drafter(target, drafter, bad)
    with pytest.raises(SpecformerError, match="nothing to score"):
        evaluate_drafter(target, drafter, records, seq_len=3)


def test_a_diverging_run_stops_instead_of_exporting_nan(tiny_checkpoints, tmp_path, use_records):
    cfg = config(tiny_checkpoints, tmp_path, lr=1e30, steps=12, warmup_frac=0.0, save_every=12)  # AdamW moves ~lr
    with pytest.raises(SpecformerError, match="training diverged"):
        trainer.train(cfg, progress=False)
    assert not (tmp_path / "drafter").exists()


def test_drafter_round_trip_and_target_mismatch(tiny_checkpoints, tmp_path):
    from specformer_jax.modeling.drafter import init_drafter

    target = load_target(tiny_checkpoints["llama3"])
    cfg = DrafterConfig(num_slots=3)
    params = init_drafter(target.cfg, cfg, jax.random.key(0))
    save_drafter(tmp_path / "d32", cfg, params, target.cfg, dtype="float32")
    loaded = load_drafter(tmp_path / "d32", target)
    assert loaded.cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_drafter(tmp_path / "d16", cfg, params, target.cfg)
    size = lambda name: (tmp_path / name / "params.safetensors").stat().st_size
    assert size("d16") < 0.6 * size("d32")
    other = load_target(tiny_checkpoints["qwen3"])
    with pytest.raises(SpecformerError, match="different target"):
        load_drafter(tmp_path / "d32", other)
    with pytest.raises(SpecformerError, match="not a drafter directory"):
        load_drafter(tmp_path, target)
    with pytest.raises(SpecformerError, match="does not exist"):
        load_drafter(tmp_path / "nope", target)


@pytest.mark.slow  # CI time: two short training runs of their own
def test_init_from_continues_a_drafter_with_the_same_settings(tiny_checkpoints, tmp_path):
    from specformer_jax.modeling.drafter import Drafter, drafter_cache, init_drafter

    target = load_target(tiny_checkpoints["llama3"])
    params = init_drafter(target.cfg, DrafterConfig(num_slots=3), jax.random.key(7))
    save_drafter(tmp_path / "d", DrafterConfig(num_slots=3), params, target.cfg, dtype="float32")
    start = trainer.initial_params(config(tiny_checkpoints, tmp_path, init_from=str(tmp_path / "d")), target)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fresh = trainer.initial_params(config(tiny_checkpoints, tmp_path), target)
    assert not np.array_equal(jax.tree.leaves(fresh)[0], jax.tree.leaves(params)[0])
    with pytest.raises(SpecformerError, match="drafter settings"):
        trainer.initial_params(config(tiny_checkpoints, tmp_path, init_from=str(tmp_path / "d"), num_slots=2), target)
    # a run may add next_token_input: same parameters plus the new input, which starts at zero
    grown = trainer.initial_params(config(tiny_checkpoints, tmp_path, init_from=str(tmp_path / "d"),
                                          next_token_input=True), target)
    assert set(grown) - set(params.weights) == {"next_norm", "next_proj"}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves({k: grown[k] for k in params.weights})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.asarray(grown["next_proj"]["kernel"]).any()
    save_drafter(tmp_path / "n", DrafterConfig(num_slots=3, next_token_input=True), DrafterParams(grown), target.cfg,
                 dtype="float32")
    with pytest.raises(SpecformerError, match="drafter settings"):  # but not drop it
        trainer.initial_params(config(tiny_checkpoints, tmp_path, init_from=str(tmp_path / "n")), target)
    # and context_token_input: the fuse reads the token's embedding through new rows, zero, so the states are v4's
    both = DrafterConfig(num_slots=3, next_token_input=True, context_token_input=True)
    grown = trainer.initial_params(config(tiny_checkpoints, tmp_path, init_from=str(tmp_path / "d"),
                                          next_token_input=True, context_token_input=True), target)
    assert set(grown) - set(params.weights) == {"next_norm", "next_proj", "context_next_norm"}
    hidden = {i: jax.random.normal(jax.random.key(i), (2, 5, target.cfg.hidden_size))
              for i in both.resolved_hooks(target.cfg)}
    nxt = jax.random.normal(jax.random.key(9), (2, 5, target.cfg.hidden_size))
    apply = lambda cfg, p, **kw: Drafter(target.cfg, cfg).apply({"params": p}, hidden,
                                                               drafter_cache(target.cfg, 2, 5), **kw)[0]
    np.testing.assert_allclose(apply(both, grown, next_embed=nxt), apply(DrafterConfig(num_slots=3), params.weights),
                               atol=1e-5)


def test_several_data_directories_are_read_in_order(tiny_checkpoints, tmp_path):
    model = load_target(tiny_checkpoints["llama3"])
    distill(model, [[1, 5], [1, 6, 7]], tmp_path / "a", max_new_tokens=4, batch_size=2, progress=False)
    distill(model, [[1, 9, 9]], tmp_path / "b", max_new_tokens=4, batch_size=2, progress=False)
    both = load_records(f"{tmp_path / 'a'}, {tmp_path / 'b'}")
    assert both == read_distilled(tmp_path / "a") + read_distilled(tmp_path / "b")
    assert [r["index"] for r in both] == [0, 1, 0]  # each keeps its own indices, so its held-out split
    with pytest.raises(SpecformerError, match="set `eval_data`"):
        load_records(" , ", "eval_data")
    with pytest.raises(SpecformerError, match="does not exist"):
        load_records(str(tmp_path / "c"))


@pytest.mark.slow
def test_decoding_accepted_length_is_what_speculative_decoding_reports(tmp_path):
    from specformer_jax.assets import DEFAULT_DRAFTER

    model = load_target("default")
    drafter = load_drafter(DEFAULT_DRAFTER, model)
    prompts = ["Give me three tips for a tidy desk.", "What does a compiler do?", "Describe a rainy morning.", "Hi!"]
    distill(model, prompts, tmp_path / "d", max_new_tokens=64, batch_size=4, progress=False, purpose="eval")
    ev = evaluate_drafter(model, drafter, read_distilled(tmp_path / "d"), seq_len=512, batch_size=4)
    spec = generate(model, prompts, max_new_tokens=64, batch_size=4, drafter=drafter,
                    draft_len=drafter.cfg.num_slots).stats
    assert ev["decoding_accepted_length"] == pytest.approx(spec["mean_accepted_length"], abs=1e-4)
    assert ev["decoding_accepted_length"] < ev["expected_accepted_length"]


def test_a_periodic_eval_with_nothing_to_score_is_refused_before_training(tiny_checkpoints, tmp_path, records,
                                                                           use_records, monkeypatch):
    """Eval answers shorter than the slots used to log a loss of 0.0000 and store it in drafter.json."""
    short = [{**r, "input_ids": r["input_ids"][: r["prompt_len"] + 2]} for r in records]  # 2 answer tokens, 3 slots
    monkeypatch.setattr(trainer, "load_records", lambda *a, **k: short)
    with pytest.raises(SpecformerError, match=r"periodic eval's data \(held out\): no answer position has 3 "
                                              "answer tokens after it within seq_len 40: nothing to score"):
        trainer.train(config(tiny_checkpoints, tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


# CI time: 40 holds every row whole; 6 and 12 cut rows inside their prompts and answers
@pytest.mark.parametrize("seq_len", [pytest.param(n, marks=pytest.mark.slow) for n in (6, 12, 40)])
def test_scored_positions_count_what_the_loss_scores(tiny_checkpoints, records, seq_len):
    """dataset.scored_positions (host arithmetic) against the positions the jitted loss counts."""
    from specformer_jax.training.data.batches import eval_batches
    from specformer_jax.training.data.dataset import scored_positions
    from specformer_jax.training.loss import drafter_loss

    target = load_target(tiny_checkpoints["llama3"])
    cfg = DrafterConfig(num_slots=3)
    params = trainer.init_drafter(target.cfg, cfg, jax.random.key(0))
    cut = [{**r, "input_ids": r["input_ids"][: r["prompt_len"] + n % 7]} for n, r in enumerate(records)]
    b = eval_batches(cut, seq_len=seq_len, batch_size=len(cut), num_batches=1)[0]
    sums = drafter_loss(params, target.params, b["tokens"], b["label_mask"], target_cfg=target.cfg,
                        drafter_cfg=cfg)[1]
    assert scored_positions(cut, seq_len, 3) == int(sums["positions"])
