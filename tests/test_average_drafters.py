"""`specformer average-drafters`: the weights are the mean of the drafters' (against numpy over their files), the
draft vocabulary (or none) and settings the last one's, the sources recorded, no eval carried over; drafters of other
shapes, one drafter alone, the same drafter twice and an occupied --out are refused in one line."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest

from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checkpoints.safetensors_io import read_safetensors
from specformer_jax.cli import main
from specformer_jax.config import DrafterConfig
from specformer_jax.files import file_sha256
from specformer_jax.modeling.drafter import init_drafter


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return tiny_checkpoints["qwen2"], load_target(tiny_checkpoints["qwen2"])


def saved(target, path, seed, size=32, **kw):
    """A random drafter with a draft vocabulary of `size` random ids (None: the whole vocabulary), written in float32
    (as training keeps it), with an eval of its own."""
    cfg = DrafterConfig(num_slots=kw.pop("num_slots", 3), draft_vocab_size=size, next_token_input=True, **kw)
    rng = np.random.default_rng(seed)
    ids = None if size is None else np.sort(rng.choice(target.cfg.vocab_size, size, replace=False))
    save_drafter(path, cfg, init_drafter(target.cfg, cfg, jax.random.key(seed), ids), target.cfg, dtype="float32",
                 meta={"train_config": {"seed": seed}, "eval": {"acceptance_rate_per_slot": [0.5, 0.3, 0.1]}})
    return path


def test_the_average_is_the_mean_of_the_weights_with_the_last_vocabulary(target, tmp_path):
    model, loaded = target
    paths = [saved(loaded, tmp_path / f"d{seed}", seed) for seed in (0, 1, 2)]
    out = tmp_path / "mean"
    assert main(["average-drafters", "--model", str(model), "--drafters", ",".join(map(str, paths)),
                 "--out", str(out)]) == 0
    files = [read_safetensors(p / "params.safetensors") for p in paths]
    got = read_safetensors(out / "params.safetensors")
    assert set(got) == set(files[0])
    for name in got:
        if name == "draft_vocab":
            np.testing.assert_array_equal(got[name], files[-1][name])
            assert not np.array_equal(files[0][name], files[-1][name])  # the vocabularies differ
            continue
        mean = (np.asarray(files[0][name], np.float64) + files[1][name] + files[2][name]) / 3
        assert got[name].dtype == ml_dtypes.bfloat16
        np.testing.assert_allclose(np.asarray(got[name], np.float64), mean, rtol=2**-8, atol=0)  # bfloat16 rounding
    meta = json.loads((out / "drafter.json").read_text())
    assert meta["averaged_from"] == [{"drafter": str(p), "sha256": file_sha256(p / "params.safetensors")}
                                     for p in paths]
    assert meta["train_config"] == {"seed": 2} and meta["drafter"]["draft_vocab_size"] == 32
    assert "eval" not in meta  # the sources' acceptance is not the average's (--draft-len auto reads it)
    assert load_drafter(out, loaded).cfg == load_drafter(paths[-1], loaded).cfg


def test_drafters_that_cannot_be_averaged_are_refused_in_one_line(target, tmp_path, cli_error):
    model, loaded = target
    a, b = saved(loaded, tmp_path / "a", 0), saved(loaded, tmp_path / "b", 1, size=40)  # vocabularies may differ
    slots = saved(loaded, tmp_path / "slots", 2, num_slots=2)
    run = ["average-drafters", "--model", str(model), "--out", str(tmp_path / "out"), "--drafters"]
    assert "num_slots 3 against 2" in cli_error(run + [f"{a},{slots}"])
    assert "at least two drafters" in cli_error(run + [f"{a},"])
    assert "random has no trained weights" in cli_error(run + [f"{a},random"])
    assert "does not exist" in cli_error(run + [f"{a},{tmp_path / 'none'}"])
    assert "drafters 1 and 2 are the same file" in cli_error(run + [f"{a},{tmp_path}/./a"])
    assert main(run + [f"{a},{b}"]) == 0
    assert load_drafter(tmp_path / "out", loaded).cfg.draft_vocab_size == 40  # the last one's vocabulary
    assert "already holds a drafter" in cli_error(run + [f"{a},{b}"])
    whole = saved(loaded, tmp_path / "whole", 3, size=None)  # the whole vocabulary last: the average drafts over it
    assert main(run[:4] + [str(tmp_path / "out2"), "--drafters", f"{a},{whole}"]) == 0
    assert "draft_vocab" not in read_safetensors(tmp_path / "out2" / "params.safetensors")
