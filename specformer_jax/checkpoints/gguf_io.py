"""Load a GGUF file (llama, qwen2, qwen3 architectures): metadata -> config, dequantized tensors -> parameters."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from specformer_jax.checkpoints.convert import params_from_hf
from specformer_jax.checkpoints.gguf_file import read_gguf
from specformer_jax.config import RopeConfig, TargetConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.files import cache_dir

_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def gguf_name(hf: str) -> str:
    """The GGUF name of a tensor given its Hugging Face name (the inverse of _hf_name)."""
    by_hf = {h: g for g, h in _GLOBAL_NAMES.items()}
    parts = hf.split(".", 3)
    if hf in by_hf:
        return by_hf[hf]
    layer = {h: g for g, h in _LAYER_NAMES.items()}
    if hf.startswith("model.layers.") and len(parts) == 4 and parts[3] in layer:
        return f"blk.{parts[2]}.{layer[parts[3]]}"
    return hf


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of q/k (its RoPE layout) to get the HF rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read(path: Path):
    try:
        return read_gguf(path)
    except Exception as e:  # ValueError, struct.error or OSError for a damaged file
        raise SpecformerError(f"cannot read GGUF file {path}: {e}") from None


def load_gguf(path: Path, dtype: str | None = None):
    """(config, params, eos_ids, tokenizer) from a GGUF file."""
    import gguf.quants

    meta, tensor_list = _read(path)
    arch = meta.get("general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise SpecformerError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCH_TO_MODEL_TYPE)})")
    names = {t.name for t in tensor_list}

    def need(key: str):
        if key not in meta:
            raise SpecformerError(f"GGUF file {path} has no {key!r} in its metadata")
        return meta[key]

    try:  # TargetConfig checks the values (a head count of 0, a width that does not divide)
        cfg = TargetConfig(
            vocab_size=meta.get(f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
            hidden_size=need(f"{arch}.embedding_length"),
            intermediate_size=need(f"{arch}.feed_forward_length"),
            num_layers=need(f"{arch}.block_count"),
            num_heads=need(f"{arch}.attention.head_count"),
            num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", meta[f"{arch}.attention.head_count"]),
            head_dim=meta.get(f"{arch}.attention.key_length"),  # None: hidden_size // heads
            rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope=RopeConfig(theta=meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position=meta.get(f"{arch}.context_length", 4096),
            tie_embeddings="output.weight" not in names,
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            model_type=_ARCH_TO_MODEL_TYPE[arch],
            dtype=dtype or "float32",
        )
    except SpecformerError as e:
        raise SpecformerError(f"GGUF file {path}: {e}") from None
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise SpecformerError("GGUF files with RoPE scaling are not supported yet")
    tensors = {}
    for t in tensor_list:
        hf = _hf_name(t.name)
        if hf is None:
            continue
        w = np.asarray(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType(t.tensor_type)), dtype=np.float32)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute(w, cfg.num_heads if "attn_q" in t.name else cfg.num_kv_heads)
        tensors[hf] = w
    params = params_from_hf(tensors.__getitem__, cfg)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return cfg, params, (() if eos is None else (int(eos),)), _tokenizer(path)


def _tokenizer(path: Path):
    """Tokenizer from GGUF metadata via transformers (slow: ~10 s), cached on disk as a converted tokenizer.json."""
    from transformers import AutoTokenizer

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types for unsupported tokenizer metadata
        raise SpecformerError(f"cannot build a tokenizer from {path}: {e}") from None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            tok.save_pretrained(tmp)
            try:
                os.replace(tmp, cached)  # atomic; a concurrent writer that won the race is fine too
            except OSError:
                pass
            else:
                os.makedirs(tmp)  # let TemporaryDirectory clean up the now-empty name
    except OSError:  # a read-only or full cache: the tokenizer works, it is built again next time
        pass
    return tok
