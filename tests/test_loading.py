"""Checkpoint loading details: sharded safetensors, bfloat16, the default-model cache, malformed files."""

from __future__ import annotations

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specformer_jax.checkpoints import default as default_model
from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checkpoints.safetensors_io import read_safetensors, write_safetensors
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import KVCache

ROW = [5, 17, 3, 99, 42, 7, 8, 11]


def logits_of(m, row=ROW):
    cache = KVCache.zeros(m.cfg.num_layers, 1, 16, m.cfg.num_kv_heads, m.cfg.head_dim, m.cfg.dtype)
    return np.asarray(m.module().apply({"params": m.params}, jnp.asarray([row]), cache)[0][0])


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["qwen2"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    np.testing.assert_array_equal(logits_of(load_target(tmp_path)), logits_of(load_target(src)))


def test_bfloat16_checkpoint_runs_in_bfloat16(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama3"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    m = load_target(tmp_path)
    assert m.cfg.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(m.params))
    with torch.no_grad():
        ref = hf.float()(torch.tensor([ROW])).logits[0].numpy()  # same bf16 weights, computed in float32
    got = logits_of(m)
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()  # bf16 activations: loose, but the same function
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75


def test_default_model_cache_rejects_a_corrupt_file(tmp_path, monkeypatch):
    """A cached GGUF with the wrong checksum is deleted and fetched again, never used."""
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model, "_installed_copy", lambda: None)
    (tmp_path / default_model.GGUF_NAME).write_bytes(b"not the model")
    fetched = []

    def fake_download(dest):
        fetched.append(dest)
        dest.write_bytes(b"fresh")

    monkeypatch.setattr(default_model, "_download", fake_download)
    monkeypatch.setattr(default_model, "file_sha256",
                        lambda p: default_model.GGUF_SHA256 if p.read_bytes() == b"fresh" else "x")
    assert default_model.default_model_path() == tmp_path / default_model.GGUF_NAME
    assert fetched == [tmp_path / default_model.GGUF_NAME]


def edit_json(path, edit):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(edit(doc)))


@pytest.mark.parametrize("edit, message", [
    (lambda c: [1, 2], "config.json must be a JSON object"),
    (lambda c: {**c, "hidden_size": "abc"}, "config.json: hidden_size must be a positive integer, got 'abc'"),
    (lambda c: {**c, "hidden_size": None}, "config.json: hidden_size must be a positive integer, got None"),
    (lambda c: {**c, "num_attention_heads": 0}, "config.json: num_attention_heads must be a positive integer, got 0"),
    (lambda c: {**c, "vocab_size": 12.5}, "config.json: vocab_size must be a positive integer, got 12.5"),
    (lambda c: {**c, "rms_norm_eps": -1e-5}, "config.json: rms_norm_eps must be a positive finite number, got -1e-05"),
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_theta": "big"}},
     "config.json: rope_theta must be a positive finite number, got 'big'"),
    (lambda c: {**c, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
     "config.json: hidden_size (64) must be a multiple of num_attention_heads (3) when head_dim is not given"),
])
def test_malformed_config_json(cli_error, tiny_checkpoints, tmp_path, edit, message):
    d = shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "m")
    edit_json(d / "config.json", edit)
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert f"{d}/{message}" in line


def test_target_config_checks_values_from_any_source():
    """GGUF metadata builds TargetConfig directly: the same checks apply, named by their config.json keys."""
    shape = dict(vocab_size=0, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(SpecformerError, match="vocab_size must be a positive integer, got 0"):
        TargetConfig(**shape)
    with pytest.raises(SpecformerError, match="rms_norm_eps must be a positive finite number, got nan"):
        TargetConfig(**{**shape, "vocab_size": 128}, rms_norm_eps=float("nan"))
    assert TargetConfig(**{**shape, "vocab_size": 128}).head_dim == 16


def test_safetensors_header_that_is_not_an_object(cli_error, tiny_checkpoints, tmp_path):
    d = shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 8) + b"[1, 2]  ")
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert f"corrupt safetensors file {f}: header is not a JSON object" in line


def test_layer_tensor_with_the_wrong_shape(cli_error, tiny_checkpoints, tmp_path):
    """One layer's tensor differing from the others' is named, not a numpy error from stacking the layers."""
    d = shutil.copytree(tiny_checkpoints["llama3"], tmp_path / "m")
    tensors = {k: np.array(v) for k, v in read_safetensors(d / "model.safetensors").items()}
    tensors["model.layers.1.self_attn.q_proj.weight"] = np.zeros((67, 64), np.float32)
    write_safetensors(d / "model.safetensors", tensors)
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert "tensor model.layers.1.self_attn.q_proj.weight has shape (67, 64); the config implies (64, 64)" in line


@pytest.fixture(scope="module")
def tiny_drafter(tiny_checkpoints, tmp_path_factory):
    target = load_target(tiny_checkpoints["llama3"])
    cfg = DrafterConfig(num_slots=2)
    d = tmp_path_factory.mktemp("drafter") / "d"
    save_drafter(d, cfg, init_drafter(target.cfg, cfg, jax.random.key(0)), target.cfg, dtype="float32")
    return target, d


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "target": "llama"}, "drafter.json is malformed: target must be an object"),
    (lambda m: {**m, "drafter": {**m["drafter"], "hooks": "abc"}},
     "drafter.json is malformed: hooks must be a list of integers"),
    (lambda m: {**m, "drafter": {**m["drafter"], "hooks": [0, 1.5]}},
     "drafter.json is malformed: hooks must be a list of integers"),
    (lambda m: {**m, "eval": {"acceptance_rate_per_slot": [float("nan"), 0.5]}},
     "drafter.json: eval.acceptance_rate_per_slot must be numbers in [0, 1]"),
    (lambda m: {**m, "eval": {"acceptance_rate_per_slot": ["0.5", 0.2]}},
     "drafter.json: eval.acceptance_rate_per_slot must be numbers in [0, 1]"),
    (lambda m: {**m, "eval": {"acceptance_rate_per_slot": [1.5, 0.2]}},
     "drafter.json: eval.acceptance_rate_per_slot must be numbers in [0, 1]"),
])
def test_malformed_drafter_json(tiny_drafter, tmp_path, edit, message):
    target, src = tiny_drafter
    assert load_drafter(src, target).cfg.num_slots == 2  # no recorded eval: fine
    d = shutil.copytree(src, tmp_path / "d")
    edit_json(d / "drafter.json", edit)
    with pytest.raises(SpecformerError) as e:
        load_drafter(d, target)
    assert f"{d}/{message}" in str(e.value)
