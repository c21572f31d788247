"""Target states cached once (`specformer cache-states`), so that drafter training reads them instead of running the
frozen target at every step.

The drafter sees the target only through the hidden states it hooks (and, under the kl objective, the final-normed
states whose distributions the slots learn). They depend on the target and the tokens alone, so one pass over the
data serves every step and every later run on it: a training step then costs the drafter and its head.

A cache directory holds:
  manifest.json       what the states belong to: the target (a hash of its parameters), the data (a hash of its
                      records), the hooks, the sequence length, and which shards are done (`complete` once all are)
  states-00000.npy    the states of `shard_records` consecutive records: bfloat16 (stored as its uint16 bits)
                      [tokens, hooks, d], each record's first min(len, seq_len) positions one after another

A target is causal, so the states of a sequence cut to seq_len are those of its first seq_len positions: a cache
serves any run whose seq_len is at most its own. Shards are written atomically and the manifest after each, so an
interrupted build resumes with the same command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from specformer_jax.errors import SpecformerError
from specformer_jax.files import atomic_open, read_json, write_json
from specformer_jax.training.data.dataset import data_dirs
from specformer_jax.training.loss import target_hidden

FORMAT = "specformer-states-v1"
MANIFEST = "manifest.json"
SHARD_RECORDS = 256  # records per shard: ~1.4 GiB of states for SmolLM2's four hooks at 512 tokens a record
PAD_TO = 64  # a batch's length is padded to a multiple of this (fewer shapes to compile)


def params_sha256(params) -> str:
    """Hex SHA-256 of a parameter tree: every leaf's path, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        x = np.asarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{x.dtype}:{x.shape};".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def records_sha256(records: list[dict]) -> str:
    """Hex SHA-256 of distilled records in order (index, prompt length, token ids): the same for JSONL and packed."""
    h = hashlib.sha256()
    for r in records:
        ids = np.asarray(r["input_ids"], np.int64)
        h.update(np.asarray([r["index"], r["prompt_len"], len(ids)], np.int64).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def shard_file(out: Path, k: int) -> Path:
    return Path(out) / f"states-{k:05d}.npy"


@partial(jax.jit, static_argnames=("target_cfg", "hooks"))
def _hooked(target_cfg, target_params, tokens, hooks):
    """[B, T, len(hooks), d] bfloat16: the target's hooked states over whole sequences."""
    hidden = target_hidden(target_cfg, target_params, tokens, hooks)
    return jnp.stack([hidden[i] for i in hooks], axis=2).astype(jnp.bfloat16)


def _shard_states(target, records: list[dict], hooks: tuple[int, ...], seq_len: int, batch_size: int,
                  done=lambda n: None) -> np.ndarray:
    """uint16 [tokens, hooks, d]: the bfloat16 bits of each record's states, records one after another. Records are
    batched shortest first and put back in order: a batch pads to its longest record, so records of like lengths
    together waste the fewest positions (docs/training.md gives the figures). done(n): called after each batch of n
    records (the progress bar)."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    parts = [None] * len(records)
    for i in range(0, len(order), batch_size):
        rows = order[i: i + batch_size]
        batch = [records[j]["input_ids"][:seq_len] for j in rows]
        T = min(-(-max(map(len, batch)) // PAD_TO) * PAD_TO, seq_len)
        tokens = np.zeros((batch_size, T), np.int32)  # full batches only: one shape per length
        for row, ids in enumerate(batch):
            tokens[row, : len(ids)] = ids
        states = np.asarray(_hooked(target.cfg, target.params, tokens, hooks))
        for row, (j, ids) in enumerate(zip(rows, batch)):
            parts[j] = states[row, : len(ids)]
        done(len(batch))
    return np.concatenate(parts).view(np.uint16)


def _manifest(target, records, data: str, hooks, seq_len: int, shard_records: int) -> dict:
    num_shards = -(-len(records) // shard_records)
    return {"format": FORMAT, "target_sha256": params_sha256(target.params), "target_source": target.source,
            "data": data, "data_sha256": records_sha256(records), "num_records": len(records),
            "hooks": list(hooks), "seq_len": seq_len, "hidden_size": target.cfg.hidden_size, "dtype": "bfloat16",
            "shard_records": shard_records, "num_shards": num_shards, "shards_done": [], "complete": False}


_IDENTITY = ("target_sha256", "data_sha256", "hooks", "seq_len", "shard_records")


def cache_states(target, records: list[dict], out: str | Path, *, hooks: tuple[int, ...], seq_len: int, data: str = "",
                 batch_size: int = 8, shard_records: int = SHARD_RECORDS, progress: bool = True) -> dict:
    """Write (or finish) the cache of `target`'s `hooks` states over `records` cut to `seq_len` in `out`. A directory
    holding an unfinished cache of the same target, data, hooks and length is resumed; any other content is refused.
    Returns {"shards_written", "shards_skipped", "tokens", "seconds", "out"}."""
    out = Path(out)
    hooks = tuple(dict.fromkeys(target.cfg.hook_index(i) for i in hooks))  # once each, in order
    mine = _manifest(target, records, data, hooks, seq_len, shard_records)
    manifest = _resumable(out, mine)
    todo = [k for k in range(manifest["num_shards"]) if k not in manifest["shards_done"]]
    t0, tokens = time.perf_counter(), 0
    left = sum(len(records[k * shard_records: (k + 1) * shard_records]) for k in todo)
    bar = tqdm(total=len(records), initial=len(records) - left, unit="record",
               desc="cache-states", file=sys.stderr, disable=not progress)
    for k in todo:
        shard = records[k * shard_records: (k + 1) * shard_records]
        states = _shard_states(target, shard, hooks, seq_len, batch_size, bar.update)
        with atomic_open(shard_file(out, k), "wb") as f:
            np.save(f, states)
        manifest["shards_done"] = sorted(manifest["shards_done"] + [k])
        manifest["complete"] = len(manifest["shards_done"]) == manifest["num_shards"]
        write_json(out / MANIFEST, manifest)
        tokens += states.shape[0]
    bar.close()
    return {"shards_written": len(todo), "shards_skipped": manifest["num_shards"] - len(todo), "tokens": tokens,
            "seconds": time.perf_counter() - t0, "out": str(out)}


def _resumable(out: Path, mine: dict) -> dict:
    """The manifest to continue from: `mine` for a new or empty directory, the saved one for the same cache."""
    if out.exists() and not out.is_dir():
        raise SpecformerError(f"--out {out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        write_json(out / MANIFEST, mine)
        return mine
    saved = _read_manifest(out)
    differ = [k for k in _IDENTITY if saved.get(k) != mine[k]]
    if differ:
        raise SpecformerError(f"{out} holds a cache of another {', '.join(differ)}: choose a new --out")
    return saved


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not file.is_file():
        raise SpecformerError(f"{path} is not a state cache (no {MANIFEST}); make one with `specformer cache-states`")
    manifest = read_json(file, "state cache manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SpecformerError(f"{file} is not a {FORMAT} manifest")
    return manifest


@dataclasses.dataclass
class StateCache:
    """An opened, checked cache: the states of record `position` (its place in the data) as training reads them."""

    path: Path
    manifest: dict
    columns: list[int]  # the cache's hook positions of the hooks a run reads, in the run's order
    starts: np.ndarray  # per record: its first row in its shard
    lengths: np.ndarray  # per record: its cached positions

    def rows(self, position: int, seq_len: int) -> np.ndarray:
        """bfloat16 [seq_len, hooks read, d]: the record's states, zero past its end."""
        shard_records = self.manifest["shard_records"]
        states = self._shard(position // shard_records)
        n, start = min(int(self.lengths[position]), seq_len), int(self.starts[position])
        out = np.zeros((seq_len, len(self.columns), states.shape[-1]), np.uint16)
        out[:n] = states[start: start + n][:, self.columns]
        return out.view(ml_dtypes.bfloat16)

    def _shard(self, k: int) -> np.ndarray:
        return np.load(shard_file(self.path, k), mmap_mode="r")  # memory-mapped: opening is cheap, pages are shared


def open_cache(path: str | Path, target, records: list[dict], hooks: tuple[int, ...], seq_len: int,
               target_sha256: str | None = None) -> StateCache:
    """The cache at `path`, refused in one line unless it holds `target`'s `hooks` states over exactly these records
    to at least `seq_len` positions, complete. target_sha256: params_sha256(target.params) when the caller has it
    (hashing the target's weights is most of the check)."""
    path = Path(path)
    m = _read_manifest(path)
    where = f"states {path}"
    if not m.get("complete"):
        raise SpecformerError(f"{where} is unfinished ({len(m['shards_done'])} of {m['num_shards']} shards): rerun "
                              "`specformer cache-states` with the same arguments to finish it")
    if m["target_sha256"] != (target_sha256 or params_sha256(target.params)):
        raise SpecformerError(f"{where} was made with another target ({m.get('target_source')}) than {target.source}: "
                              "make a cache with this model")
    if m["data_sha256"] != records_sha256(records):
        raise SpecformerError(f"{where} was made from other data ({m.get('data')}) than this run's: make a cache of "
                              "the run's data")
    missing = [i for i in hooks if i not in m["hooks"]]
    if missing:
        raise SpecformerError(f"{where} holds hooks {m['hooks']}; this run reads {list(hooks)} (missing {missing}): "
                              "make a cache with --hooks covering them")
    if m["seq_len"] < seq_len:
        raise SpecformerError(f"{where} holds {m['seq_len']} positions a record; this run's seq_len is {seq_len}: "
                              "lower seq_len or make a cache with a longer --seq-len")
    lengths = np.asarray([min(len(r["input_ids"]), m["seq_len"]) for r in records])
    shard = np.arange(len(records)) // m["shard_records"]
    ends = np.cumsum(lengths)
    firsts = np.concatenate([[0], ends[:-1]])
    starts = firsts - firsts[np.searchsorted(shard, shard)]  # rows from the start of each record's shard
    return StateCache(path, m, [m["hooks"].index(i) for i in hooks], starts, lengths)


@dataclasses.dataclass
class StateCaches:
    """Caches that together hold the states of one run's data, each of the records that follow the last's (one per
    data directory, say): the states of record `position` as training reads them."""

    parts: list[StateCache]
    firsts: np.ndarray  # each part's first record in the data

    def rows(self, position: int, seq_len: int) -> np.ndarray:
        k = int(np.searchsorted(self.firsts, position, side="right")) - 1
        return self.parts[k].rows(position - int(self.firsts[k]), seq_len)


def open_caches(paths: str, target, records: list[dict], hooks: tuple[int, ...], seq_len: int) -> StateCaches:
    """The caches of a `states` setting ("dir1,dir2"), each checked by `open_cache` against the records it holds:
    the first cache's come first in `records`, the next one's after them, and together they hold all of them."""
    dirs = data_dirs(paths, "states")
    if not dirs:
        raise SpecformerError("states: give a directory written by `specformer cache-states` (several: dir1,dir2)")
    counts = [_read_manifest(d)["num_records"] for d in dirs]
    if sum(counts) != len(records):
        raise SpecformerError(f"states {paths} hold the states of {sum(counts)} records, the data has {len(records)}: "
                              "give one cache per data directory, in the data's order (or one cache of all of it)")
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    sha = params_sha256(target.params)  # once for all the caches
    parts = [open_cache(d, target, records[a: a + n], hooks, seq_len, sha) for d, a, n in zip(dirs, firsts, counts)]
    return StateCaches(parts, firsts)
