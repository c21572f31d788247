"""Distilled data in a compact form that can be kept and carried (`specformer pack-data`): the token ids of every
record as unsigned 16-bit integers (32-bit for vocabularies past 65,536), compressed, in shards holding at most
`max_bytes` (16 MiB) of token data each (the compressed file is smaller, bar a few hundred bytes of archive), so a
later training run reads them instead of distilling again.

A packed directory holds the source's manifest, with "shard_format": "npz", and shards shard-00000.npz, ... Each
shard is a NumPy .npz of four arrays: `tokens` (every record's input_ids, concatenated), `lengths`, `prompt_len` and
`index` (one entry per record). Training, evaluation and `eval-drafter` read it as they read the JSONL shards
(dataset.read_distilled, which holds the reader); the records are the same.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from specformer_jax.errors import SpecformerError
from specformer_jax.files import atomic_open, write_atomic
from specformer_jax.training.data.dataset import MANIFEST, read_distilled, read_manifest, shard_path

MAX_SHARD_BYTES = 16 * 2**20
NPZ = "npz"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def pack(src: str | Path, out: str | Path, max_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write the records of the finished distillation `src` to `out` in the packed form; returns what was written
    (records, tokens, shards, bytes). `out` must be new or empty."""
    src = Path(src)
    return pack_records(read_distilled(src), read_manifest(src), out, max_bytes)


def pack_records(records: list[dict], manifest: dict, out: str | Path, max_bytes: int = MAX_SHARD_BYTES) -> dict:
    """`pack` for records already read (a part of a data set, say), with the manifest of the data they came from;
    returns what was written. `out` must be new or empty."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecformerError(f"output directory {out} exists and is not empty; pick a new --out")
    dtype = token_dtype(manifest["vocab_size"])
    shards = _split(records, max_bytes // dtype.itemsize)
    sizes = [_write_shard(shard_path(out, k, NPZ), shard, dtype) for k, shard in enumerate(shards)]
    packed = {**manifest, "shard_format": NPZ, "token_dtype": dtype.name, "num_shards": len(shards),
              "shards_done": list(range(len(shards))), "complete": True}
    write_atomic(out / MANIFEST, json.dumps(packed, indent=1) + "\n")
    return {"records": len(records), "tokens": sum(len(r["input_ids"]) for r in records), "shards": len(shards),
            "bytes": sum(sizes)}


def _split(records: list[dict], max_tokens: int) -> list[list[dict]]:
    """Consecutive groups of records of at most max_tokens tokens each (uncompressed, so compressed too)."""
    shards, current, size = [], [], 0
    for rec in records:
        n = len(rec["input_ids"])
        if n > max_tokens:
            raise SpecformerError(f"record {rec['index']} has {n} tokens: more than one shard holds")
        if current and size + n > max_tokens:
            shards.append(current)
            current, size = [], 0
        current.append(rec)
        size += n
    return shards + [current] if current else shards


def _write_shard(path: Path, records: list[dict], dtype: np.dtype) -> int:
    buf = io.BytesIO()
    np.savez_compressed(
        buf, tokens=np.concatenate([np.asarray(r["input_ids"], dtype) for r in records]),
        lengths=np.asarray([len(r["input_ids"]) for r in records], np.int32),
        prompt_len=np.asarray([r["prompt_len"] for r in records], np.int32),
        index=np.asarray([r["index"] for r in records], np.int64))
    data = buf.getvalue()
    with atomic_open(path, "wb") as f:
        f.write(data)
    return len(data)
