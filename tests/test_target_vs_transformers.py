"""Our Flax target against transformers' PyTorch models: logits (prefill and cached extension) and greedy tokens."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.modeling.kv_cache import KVCache

FAMILIES = ["llama3", "mistral", "qwen2", "qwen3"]
ROWS = [[5, 17, 3, 99, 42, 7, 8, 11, 64, 23, 31, 90, 12, 77], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6]]


def hf_logits(path, rows):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([r])).logits[0].numpy() for r in rows], model


def padded(rows):
    T = max(len(r) for r in rows)
    arr = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    return jnp.asarray(arr), jnp.asarray([len(r) for r in rows], jnp.int32)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_cached_extension_match_transformers(tiny_checkpoints, family):
    path = tiny_checkpoints[family]
    ref, _ = hf_logits(path, ROWS)
    m = load_target(path)
    cfg, model = m.cfg, m.module()
    apply = jax.jit(lambda p, t, c, n: model.apply({"params": p}, t, c, n))
    B = len(ROWS)

    # (a) one ragged prefill of every whole row
    tokens, lens = padded(ROWS)
    cache = KVCache.zeros(cfg.num_layers, B, 32, cfg.num_kv_heads, cfg.head_dim)
    logits, cache, _ = apply(m.params, tokens, cache, lens)
    for i, r in enumerate(ROWS):
        np.testing.assert_allclose(np.asarray(logits[i, : len(r)]), ref[i], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [len(r) for r in ROWS])

    # (b) ragged prefill of a different prefix per row, then one token at a time through the cache
    prefix = [6, 1, 3]
    tokens, lens = padded([r[:p] for r, p in zip(ROWS, prefix)])
    cache = KVCache.zeros(cfg.num_layers, B, 32, cfg.num_kv_heads, cfg.head_dim)
    logits, cache, _ = apply(m.params, tokens, cache, lens)
    got = [[np.asarray(logits[i, j]) for j in range(p)] for i, p in enumerate(prefix)]
    for step in range(max(len(r) for r in ROWS)):
        pos = [min(p + step, len(r) - 1) for r, p in zip(ROWS, prefix)]
        tok = jnp.asarray([[r[q]] for r, q in zip(ROWS, pos)], jnp.int32)
        live = jnp.asarray([p + step < len(r) for r, p in zip(ROWS, prefix)], jnp.int32)
        logits, cache, _ = apply(m.params, tok, cache, live)  # finished rows add 0 to their length
        for i in range(B):
            if live[i]:
                got[i].append(np.asarray(logits[i, 0]))
    for i, r in enumerate(ROWS):
        np.testing.assert_allclose(np.stack(got[i]), ref[i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_greedy_tokens_match_transformers_generate(tiny_checkpoints, family, tmp_path, capsys):
    path = tiny_checkpoints[family]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ROWS))
    rc = main(["generate", "--model", str(path), "--prompts-file", str(prompts), "--max-new-tokens", "12", "--json"])
    assert rc == 0
    results = json.loads(capsys.readouterr().out)["results"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for r, res in zip(ROWS, results):
        ref = model.generate(torch.tensor([r]), do_sample=False, max_new_tokens=12, eos_token_id=2, pad_token_id=0)
        assert res["token_ids"] == ref[0, len(r) :].tolist()


def test_hidden_state_hooks_match_transformers(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    row = ROWS[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([row]), output_hidden_states=True).hidden_states  # L + 1 entries, last one normed
    m = load_target(path)
    model = m.module(hooks=(0, 1, -1))
    cache = KVCache.zeros(m.cfg.num_layers, 1, 16, m.cfg.num_kv_heads, m.cfg.head_dim)
    _, _, hidden = model.apply({"params": m.params}, jnp.asarray([row]), cache)
    for idx in (0, 1, 2):
        np.testing.assert_allclose(np.asarray(hidden[idx][0]), ref[idx][0].numpy(), atol=1e-4, rtol=0)



def test_rope_table_matches_transformers_rotation_far_into_the_cache():
    """RoPE from the table of a cache's positions (`rope_table`) against transformers' Llama rotation
    (LlamaRotaryEmbedding's cos and sin, applied by apply_rotary_pos_emb) at positions up to 8,191, given our
    frequencies (llama3-scaled): both sides take float32 products for the angles, so only the last bits of the
    cosines and sines may differ."""
    from transformers.models.llama import modeling_llama as hf

    from specformer_jax.config import RopeConfig
    from specformer_jax.modeling.layers import rope, rope_table

    inv_freq = RopeConfig(theta=500000.0, kind="llama3", factor=8.0).inv_freq(64)
    rotary = hf.LlamaRotaryEmbedding(transformers.LlamaConfig(hidden_size=256, num_attention_heads=4))
    rotary.inv_freq = torch.tensor(inv_freq, dtype=torch.float32)
    positions = np.array([[0, 1, 2, 31], [1000, 4095, 8190, 8191]], np.int32)
    x = np.random.default_rng(0).normal(size=(2, 4, 3, 64)).astype(np.float32)  # [B, T, H, D]
    cos, sin = rotary(torch.zeros(1), torch.from_numpy(positions).long())
    want, _ = hf.apply_rotary_pos_emb(torch.from_numpy(x).transpose(1, 2), torch.zeros(2, 3, 4, 64), cos, sin)
    got = rope(jnp.asarray(x), rope_table(jnp.asarray(positions), inv_freq, 8192))
    np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=2e-6, rtol=1e-5)
