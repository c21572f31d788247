"""Shared fixtures: tiny random-weight HF checkpoints (built offline with transformers, saved with save_pretrained)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent compile cache for the session, in a temporary directory (not the CLI's SPECFORMER_CACHE/xla),
# shared by the CLI subprocesses: programs compiled again, by another test or a run that starts over, load from it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="specformer-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every program goes into it, not only those that took a second to compile (JAX's default): the tests compile many
# small programs of the same shapes again and again (test_set_acceptance.py with test_engine.py: 131 s -> 101 s).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest


@pytest.fixture(autouse=True)
def _decoding_records_stay_out_of_the_user_cache(monkeypatch, tmp_path_factory):
    """The CLI records what speculative decoding measured for `--draft-len auto` (decoding/records.py). A test's
    records go to a fresh directory, so tests neither teach the developer's own cache nor read what other tests
    decoded; a test that sets SPECFORMER_CACHE itself gets that directory. (The default model's GGUF, also under
    the cache, is still found where it is.)"""
    from specformer_jax.decoding.tuning import records

    real, fresh = records.records_directory, tmp_path_factory.mktemp("records")
    monkeypatch.setattr(records, "records_directory", lambda: real() if os.environ.get("SPECFORMER_CACHE") else fresh)


COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.3,  # large weights spread the logits apart: no near-ties to flip a greedy argmax
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_configs():
    """name -> (transformers config class name, kwargs): one per supported family, each exercising its switch."""
    return {
        "llama3": ("LlamaConfig", dict(COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        "mistral": ("MistralConfig", dict(COMMON, sliding_window=8, num_key_value_heads=1)),
        "qwen2": ("Qwen2Config", dict(COMMON, tie_word_embeddings=True)),
        "qwen3": ("Qwen3Config", dict(COMMON, head_dim=32, tie_word_embeddings=True)),
    }


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """name -> directory of a saved random-weight checkpoint (float32)."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for name, (cls_name, kwargs) in tiny_configs().items():
        torch.manual_seed(0)
        cfg = getattr(transformers, cls_name)(**kwargs)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def cli_error(capsys):
    """Run the CLI on argv that must fail: returns its one error line (non-zero exit, no traceback)."""
    from specformer_jax.cli import main

    def run(argv):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse exits for bad option values
            rc = e.code
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert rc != 0 and "Traceback" not in err
        assert len(errors) == 1, err
        return errors[0]

    return run


@pytest.fixture
def use_records(monkeypatch, records):
    """Training reads the requesting module's `records` fixture instead of distilled directories."""
    from specformer_jax.training import trainer

    monkeypatch.setattr(trainer, "load_records", lambda *a, **k: records)
    monkeypatch.setattr(trainer, "check_vocabulary", lambda *a: None)  # records in memory: no manifests to check
