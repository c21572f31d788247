"""`specformer cache-states` and training from its cache: the cached states are the target's, a training step from
them equals one with the live target (to bfloat16 rounding), a cache of another target, data, hook set or length is
refused in one line, and an interrupted build resumes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_training import config as training_config

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.config import DrafterConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.training import loss, state_cache, trainer
from specformer_jax.training.data.distill import distill
from specformer_jax.training.loss import drafter_loss, hooks_read, target_hidden
from specformer_jax.training.state_cache import cache_states, open_cache, open_caches

HOOKS = (0, 1, 2)  # the tiny two-layer model's embeddings, layer 1 and the final-normed output: the default drafter's
SEQ = 40


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


@pytest.fixture(scope="module")
def records():
    """Random records of varied lengths, some longer than SEQ (their states stop there)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(23):
        prompt, answer = rng.integers(3, 128, rng.integers(3, 10)), rng.integers(3, 128, rng.integers(8, 45))
        out.append({"index": i, "input_ids": np.concatenate([prompt, answer]).tolist(), "prompt_len": len(prompt)})
    return out


@pytest.fixture(scope="module")
def cache(target, records, tmp_path_factory):
    out = tmp_path_factory.mktemp("states")
    cache_states(target, records, out, hooks=HOOKS, seq_len=SEQ, batch_size=4, shard_records=5, progress=False)
    return out


def test_cached_states_are_the_targets_over_each_record_alone(target, records, cache):
    opened = open_cache(cache, target, records, HOOKS, SEQ)
    tokens = np.zeros((len(records), SEQ), np.int32)  # all in one batch: the padding after each is never attended
    for row, r in enumerate(records):
        tokens[row, : min(len(r["input_ids"]), SEQ)] = r["input_ids"][:SEQ]
    live = target_hidden(target.cfg, target.params, jnp.asarray(tokens), HOOKS)
    for position, r in enumerate(records):
        ids = r["input_ids"][:SEQ]
        rows = opened.rows(position, SEQ).astype(np.float32)
        assert rows.shape == (SEQ, len(HOOKS), target.cfg.hidden_size)
        for j, hook in enumerate(HOOKS):  # the live states rounded to bfloat16 (half a step: 2^-8 relative)
            want = np.asarray(live[hook][position, : len(ids)])
            np.testing.assert_allclose(rows[: len(ids), j], want, rtol=2 ** -8, atol=1e-5 * np.abs(want).max())
        assert not rows[len(ids):].any()
    hooks_subset = open_cache(cache, target, records, (2, 0), 24)  # a run may read fewer hooks and positions
    np.testing.assert_array_equal(hooks_subset.rows(3, 24).astype(np.float32),
                                  opened.rows(3, 24).astype(np.float32)[:, [2, 0]])


def drafter_and_batch(target, records, opened, objective):
    drafter_cfg = DrafterConfig(num_slots=3)
    params = init_drafter(target.cfg, drafter_cfg, jax.random.key(0))
    tokens = np.zeros((4, SEQ), np.int32)
    mask = np.zeros((4, SEQ), np.int32)
    for row, r in enumerate(records[:4]):
        ids = r["input_ids"][:SEQ]
        tokens[row, : len(ids)], mask[row, r["prompt_len"]: len(ids)] = ids, 1
    states = np.stack([opened.rows(p, SEQ) for p in range(4)])
    return drafter_cfg, params, tokens, mask, states


@pytest.mark.parametrize("objective", ["ce", "kl"])
def test_the_loss_from_cached_states_is_the_live_targets_to_bfloat16_rounding(target, records, cache, objective,
                                                                                monkeypatch):
    drafter_cfg = DrafterConfig(num_slots=3)
    opened = open_cache(cache, target, records, hooks_read(target.cfg, drafter_cfg, objective), SEQ)
    _, params, tokens, mask, states = drafter_and_batch(target, records, opened, objective)

    def loss_and_grad(**kw):
        f = lambda w: drafter_loss(params.replace(weights=w), target.params, tokens, mask, target_cfg=target.cfg,
                                   drafter_cfg=drafter_cfg, chunk_positions=64, objective=objective, **kw)
        return jax.value_and_grad(f, has_aux=True)(params.weights)

    (cached, _), cached_grad = loss_and_grad(states=states)
    (live, _), live_grad = loss_and_grad()
    assert abs(float(cached) - float(live)) < 1e-2 * abs(float(live))  # the rounding's whole effect is small
    rounded = lambda *a: jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), target_hidden(*a))
    monkeypatch.setattr(loss, "target_hidden", rounded)
    (live_rounded, _), rounded_grad = loss_and_grad()  # the live target with its states rounded: the same step
    np.testing.assert_allclose(float(cached), float(live_rounded), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), cached_grad, rounded_grad)


def config(tiny_checkpoints, out, **kw):
    return training_config(tiny_checkpoints, out, **{"seq_len": SEQ, "batch_size": 4, "steps": 3, "save_every": 3,
                                                      **kw})


@pytest.mark.slow  # CI time: the loss from the cache is checked above
def test_training_from_the_cache_takes_the_live_targets_steps(tiny_checkpoints, tmp_path, cache, use_records,
                                                               monkeypatch):
    cached = trainer.train(config(tiny_checkpoints, tmp_path / "cached", states=str(cache)), progress=False)
    rounded = lambda *a: jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), target_hidden(*a))
    monkeypatch.setattr(loss, "target_hidden", rounded)
    live = trainer.train(config(tiny_checkpoints, tmp_path / "live"), progress=False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 jax.device_get(cached["state"].params), jax.device_get(live["state"].params))
    lines = lambda run: (tmp_path / run / "metrics.jsonl").read_text().splitlines()
    losses = lambda run: [json.loads(line)["loss"] for line in lines(run) if '"train"' in line]
    np.testing.assert_allclose(losses("cached"), losses("live"), rtol=1e-5)
    assert len(losses("cached")) == 3


def test_a_cache_for_another_target_data_hooks_or_length_is_refused(tiny_checkpoints, tmp_path, target, records,
                                                                    cache, use_records):
    other_target = load_target(tiny_checkpoints["mistral"])  # same vocabulary, other weights
    with pytest.raises(SpecformerError, match="another target"):
        open_cache(cache, other_target, records, HOOKS, SEQ)
    changed = [dict(r) for r in records]
    changed[7] = {**changed[7], "input_ids": changed[7]["input_ids"][:-1]}
    with pytest.raises(SpecformerError, match="other data"):
        open_cache(cache, target, changed, HOOKS, SEQ)
    with pytest.raises(SpecformerError, match=r"missing \[1\]"):
        open_cache(state_cache_with_hooks(target, records, tmp_path / "h", (0, 2)), target, records, HOOKS, SEQ)
    with pytest.raises(SpecformerError, match="seq_len is 41"):
        trainer.train(config(tiny_checkpoints, tmp_path / "long", states=str(cache), seq_len=41), progress=False)
    assert not (tmp_path / "long").exists()  # refused before anything was written


def state_cache_with_hooks(target, records, out, hooks):
    cache_states(target, records, out, hooks=hooks, seq_len=SEQ, shard_records=8, progress=False)
    return out


def test_caches_of_consecutive_parts_of_the_data_read_as_one(target, records, cache, tmp_path):
    """Caches made one per data directory serve the data of both; out of order or not covering it, refused."""
    first, second = tmp_path / "first", tmp_path / "second"
    cache_states(target, records[:10], first, hooks=HOOKS, seq_len=SEQ, batch_size=4, shard_records=4, progress=False)
    cache_states(target, records[10:], second, hooks=HOOKS, seq_len=SEQ, batch_size=3, shard_records=5,
                 progress=False)
    whole = open_cache(cache, target, records, HOOKS, SEQ)
    parts = open_caches(f"{first},{second}", target, records, HOOKS, SEQ)
    for i in range(len(records)):
        np.testing.assert_array_equal(parts.rows(i, SEQ).view(np.uint16), whole.rows(i, SEQ).view(np.uint16))
    with pytest.raises(SpecformerError, match="other data"):
        open_caches(f"{second},{first}", target, records[10:] + records[:10][::-1], HOOKS, SEQ)
    with pytest.raises(SpecformerError, match="13 records, the data has 23"):
        open_caches(str(second), target, records, HOOKS, SEQ)


def test_an_unfinished_cache_resumes_to_the_same_states(target, records, cache, tmp_path, monkeypatch):
    out = tmp_path / "c"
    built = []
    shard_states = state_cache._shard_states
    monkeypatch.setattr(state_cache, "_shard_states", lambda t, recs, *a: built.append(len(recs)) or
                        shard_states(t, recs, *a))
    cache_states(target, records, out, hooks=HOOKS, seq_len=SEQ, batch_size=4, shard_records=5, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards_done"].remove(2)  # as if stopped before shard 2 was written
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "states-00002.npy").unlink()
    with pytest.raises(SpecformerError, match="unfinished"):
        open_cache(out, target, records, HOOKS, SEQ)
    built.clear()
    summary = cache_states(target, records, out, hooks=HOOKS, seq_len=SEQ, batch_size=4, shard_records=5,
                           progress=False)
    assert built == [5] and summary["shards_skipped"] == 4
    for k in range(5):  # shards of 5, 5, 5, 5 and 3 records
        np.testing.assert_array_equal(np.load(out / f"states-{k:05d}.npy"), np.load(cache / f"states-{k:05d}.npy"))
    with pytest.raises(SpecformerError, match="another hooks"):
        cache_states(target, records, out, hooks=(0, 2), seq_len=SEQ, batch_size=4, shard_records=5, progress=False)


@pytest.mark.slow  # CI time: the cache's contents and loss are checked above
def test_the_cli_caches_distilled_data_and_train_reads_it(tiny_checkpoints, tmp_path, cli_error, target):
    model = str(tiny_checkpoints["llama3"])
    prompts = [list(range(5 + i, 12 + 2 * i)) for i in range(10)]
    distill(target, prompts, tmp_path / "data", max_new_tokens=24, batch_size=5, progress=False)
    argv = ["cache-states", "--model", model, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "states"),
            "--seq-len", str(SEQ)]
    assert main(argv) == 0
    manifest = json.loads((tmp_path / "states" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["hooks"] == [0, 1, 2] and manifest["seq_len"] == SEQ
    assert np.load(tmp_path / "states" / "states-00000.npy").dtype == np.uint16  # bfloat16 bits
    train = ["train", "--set", f"model={model}", f"data={tmp_path / 'data'}", f"out={tmp_path / 'run'}", "steps=2",
             f"seq_len={SEQ}", "batch_size=4", "num_slots=3", "eval_every=2", "eval_batches=1", "save_every=2",
             "eval_fraction=0.1"]
    assert main(train + [f"states={tmp_path / 'states'}"]) == 0
    assert (tmp_path / "run" / "drafter" / "drafter.json").is_file()
    assert "cache of another seq_len" in cli_error(argv[:-1] + ["24"])
    assert "another target" in cli_error(train + [f"states={tmp_path / 'states'}", f"out={tmp_path / 'run2'}",
                                                  f"model={tiny_checkpoints['mistral']}"])
    assert "--hooks" in cli_error(argv[:-2] + ["--hooks", "0,x"])
