"""`specformer pack-data`: distilled records as compressed token arrays in size-capped shards read back exactly as
the JSONL shards they came from, by everything that reads distilled data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specformer_jax.cli import main
from specformer_jax.errors import SpecformerError
from specformer_jax.training.data.dataset import FORMAT, load_records, read_distilled
from specformer_jax.training.data.distill import shard_text, write_manifest
from specformer_jax.training.data.packed import pack


def distilled(path, vocab_size=128, num_shards=3, per_shard=4, complete=True, seed=0):
    """A `specformer distill` directory with random records (prompt and answer lengths vary)."""
    rng = np.random.default_rng(seed)
    settings = {"format": FORMAT, "model": "m", "dtype": "float32", "vocab_size": vocab_size, "chat": True,
                "max_new_tokens": 16, "num_prompts": num_shards * per_shard, "prompts_sha256": "0",
                "shard_size": per_shard, "purpose": "train"}
    path.mkdir(parents=True)
    for k in range(num_shards if complete else num_shards - 1):
        prompts = [rng.integers(0, vocab_size, rng.integers(1, 9)).tolist() for _ in range(per_shard)]
        answers = [rng.integers(0, vocab_size, rng.integers(1, 17)).tolist() for _ in range(per_shard)]
        (path / f"shard-{k:05d}.jsonl").write_text(shard_text(k * per_shard, prompts, answers))
    write_manifest(path, settings, num_shards)
    return path


@pytest.mark.parametrize("vocab_size, dtype", [(128, "uint16"), (151936, "uint32")])
def test_packed_records_equal_the_distilled_ones(tmp_path, vocab_size, dtype):
    src = distilled(tmp_path / "src", vocab_size)
    summary = pack(src, tmp_path / "packed")
    assert read_distilled(tmp_path / "packed") == read_distilled(src)
    assert load_records(str(tmp_path / "packed")) == load_records(str(src))  # what training reads
    manifest = json.loads((tmp_path / "packed" / "manifest.json").read_text())
    assert manifest["shard_format"] == "npz" and manifest["token_dtype"] == dtype and manifest["complete"]
    assert summary["records"] == 12 and summary["shards"] == 1
    if vocab_size > 2**16:
        assert max(max(r["input_ids"]) for r in read_distilled(src)) > 2**16  # ids that 16 bits would wrap


def test_shards_stay_under_the_size_cap(tmp_path):
    src = distilled(tmp_path / "src", num_shards=4, per_shard=10)
    summary = pack(src, tmp_path / "packed", max_bytes=128)  # 64 tokens a shard at 16 bits
    shards = sorted((tmp_path / "packed").glob("shard-*.npz"))
    assert len(shards) == summary["shards"] > 4
    assert all(len(np.load(s)["tokens"]) <= 64 for s in shards)
    assert read_distilled(tmp_path / "packed") == read_distilled(src)


def test_unfinished_data_damaged_shards_and_used_directories_are_refused(tmp_path):
    with pytest.raises(SpecformerError, match="unfinished"):
        pack(distilled(tmp_path / "partial", complete=False), tmp_path / "out")
    src = distilled(tmp_path / "src")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    with pytest.raises(SpecformerError, match="not empty"):
        pack(src, tmp_path / "used")
    pack(src, tmp_path / "packed")
    (tmp_path / "packed" / "shard-00000.npz").write_bytes(b"not an archive")
    with pytest.raises(SpecformerError, match="not a packed shard"):
        read_distilled(tmp_path / "packed")


def test_cli_pack_data(tmp_path, capsys, cli_error):
    src = distilled(tmp_path / "src")
    assert main(["pack-data", str(src), "--out", str(tmp_path / "packed")]) == 0
    assert "12 records" in capsys.readouterr().err
    assert read_distilled(tmp_path / "packed") == read_distilled(src)
    assert "does not exist" in cli_error(["pack-data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
