"""Checkpoint loading details: sharded safetensors, bfloat16, the default-model cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from specformer_jax.checkpoints import default as default_model
from specformer_jax.checkpoints.loader import load_target
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
