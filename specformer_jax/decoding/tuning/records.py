"""DecodeRecords: what decoding measured, kept for `--draft-len auto` and `--verify-budget auto` (tuner.py).

Three tables: the measured cost of a plain step and of a round with k drafts (or with k drafts under each of a few
verify budgets) per setup (device, JAX, model shape, batch size, cache length, decoding code); the per-slot acceptance
measured while decoding, per drafter (greedy and sampling apart); and per drafter, batch size and k, the steps plain
decoding needs for the batches' tokens against the rounds those batches ran. A store lives in memory, or in one JSON
file: the CLI's is SPECFORMER_CACHE/decode_records.json, and the Python API writes one only when given it
(`generate(records=...)`).

Old runs fade by one rule: before a run is added, a total is scaled down so that it weighs at most
MAX_REMEMBERED_ROUNDS rounds, so the figures follow how the drafter is used now. Entries damaged by hand count as
absent: they are measured or learned again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import jax

import pallas_kernels
from specformer_jax.files import cache_dir, write_json
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget

FILE_NAME = "decode_records.json"
TABLES = ("step_costs", "acceptance", "batch_rounds")
MAX_REMEMBERED_ROUNDS = 20_000  # older decoding is forgotten beyond this many rounds, so the figures follow use

# The code a decoding round runs: its source is part of the step costs' key, so an upgrade measures again.
TIMED_CODE = [Path(__file__).parents[2] / d for d in ("decoding", "modeling")] + [Path(pallas_kernels.__file__).parent]


def records_directory() -> Path:
    """Where the CLI keeps its records: the cache directory (tests point this elsewhere)."""
    return cache_dir()


class DecodeRecords:
    """Measured step costs, decoding acceptance and batch rounds: in memory (`path` None) or in a JSON file (in
    memory from the first write its file refuses, with a warning)."""

    def __init__(self, path: str | Path | None = None):
        self.path = None if path is None else Path(path)
        self._memory: dict = {}

    @classmethod
    def default(cls) -> "DecodeRecords":
        """The store the CLI reads and writes: SPECFORMER_CACHE/decode_records.json."""
        return cls(records_directory() / FILE_NAME)

    def __repr__(self) -> str:
        return f"DecodeRecords({str(self.path) if self.path else 'in memory'})"

    def step_costs(self, model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int) -> dict | None:
        """{"step_seconds", "round_seconds": {k: seconds}} measured for this setup, or None."""
        entry = self._table("step_costs").get(_cost_key(model, drafter, batch_size, cache_len))
        try:
            return {"step_seconds": float(entry["step_seconds"]),
                    "round_seconds": {int(k): float(v) for k, v in entry["round_seconds"].items()}}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def add_step_costs(self, model, drafter, batch_size: int, cache_len: int, costs: dict) -> None:
        self._put("step_costs", _cost_key(model, drafter, batch_size, cache_len), costs)

    def budget_costs(self, model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int, k: int,
                     budgets: list[int]) -> dict | None:
        """{"step_seconds", "budget_seconds": {B: seconds}} measured for rounds with k drafts a row under each
        verify budget B of `budgets` in this setup, or None."""
        entry = self._table("step_costs").get(_cost_key(model, drafter, batch_size, cache_len, (k, budgets)))
        try:
            costs = {"step_seconds": float(entry["step_seconds"]),
                     "budget_seconds": {int(b): float(v) for b, v in entry["budget_seconds"].items()}}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return costs if sorted(costs["budget_seconds"]) == sorted(budgets) else None

    def add_budget_costs(self, model, drafter, batch_size: int, cache_len: int, k: int, budgets: list[int],
                         costs: dict) -> None:
        self._put("step_costs", _cost_key(model, drafter, batch_size, cache_len, (k, budgets)), costs)

    def acceptance(self, model: LoadedTarget, drafter: LoadedDrafter, sampled: bool) -> list[float]:
        """Per-slot acceptance measured while decoding with this drafter, for the slots drafted so far."""
        accepted, rounds = _acceptance_totals(self._table("acceptance").get(_drafter_key(model, drafter, sampled)))
        return [a / n if n else 0.0 for a, n in zip(accepted, rounds)]

    def batch_rounds(self, model: LoadedTarget, drafter: LoadedDrafter, sampled: bool,
                     batch_size: int) -> dict[int, dict]:
        """k -> {"steps", "rounds"} recorded for batches of `batch_size` rows with this drafter."""
        entries = _batch_entries(self._table("batch_rounds").get(_drafter_key(model, drafter, sampled)))
        return {k: e for (b, k), e in entries.items() if b == batch_size}

    def add_run(self, model: LoadedTarget, drafter: LoadedDrafter, sampled: bool, *, batch_size: int,
                draft_len: int, acceptance: list[float], rounds: int, plain_steps: int, batch_rounds: int) -> None:
        """Fold in one speculative run: its per-slot acceptance over `rounds` row rounds (a prefix of the slots when
        fewer were drafted), and its batches' loop iterations (`batch_rounds`) against the steps plain decoding
        needs for the same tokens (`plain_steps`)."""
        key = _drafter_key(model, drafter, sampled)
        if rounds >= 1:
            self._put("acceptance", key, _added_acceptance(self._table("acceptance").get(key), acceptance, rounds))
        if batch_rounds >= 1:
            entries = _batch_entries(self._table("batch_rounds").get(key))
            old = entries.get((batch_size, draft_len), {"steps": 0.0, "rounds": 0.0})
            entries[batch_size, draft_len] = dict(zip(("steps", "rounds"), _add(
                old["steps"], old["rounds"], plain_steps, batch_rounds)))
            self._put("batch_rounds", key, {f"{b},{k}": e for (b, k), e in entries.items()})

    def _tables(self) -> dict:
        """Every table, each a dict (a missing, unreadable or damaged file or table holds nothing)."""
        if self.path is None:
            found = self._memory
        else:
            try:
                found = json.loads(self.path.read_text())
            except (OSError, ValueError):
                found = {}
        found = found if isinstance(found, dict) else {}
        return {name: found[name] if isinstance(found.get(name), dict) else {} for name in TABLES}

    def _table(self, name: str) -> dict:
        return self._tables()[name]

    def _put(self, name: str, key: str, entry) -> None:
        tables = self._tables()
        tables[name] = {**tables[name], key: entry}
        if self.path is None:
            self._memory = tables
            return
        try:
            write_json(self.path, tables)
        except OSError as e:  # a read-only or full cache: the answers matter more than what the run taught
            print(f"specformer: warning: cannot save decoding records to {self.path} ({e.strerror or e}): what "
                  "--draft-len auto measures is kept for this process only", file=sys.stderr)
            self.path, self._memory = None, tables  # so it is not measured again at every call


def _add(total: float, weight: float, new_total: float, new_weight: float) -> tuple[float, float]:
    """A running total and its weight (rounds) with a new run added, the old ones faded to MAX_REMEMBERED_ROUNDS."""
    keep = min(1.0, MAX_REMEMBERED_ROUNDS / weight) if weight > 0 else 1.0
    return total * keep + new_total, weight * keep + new_weight


def _acceptance_totals(entry) -> tuple[list[float], list[float]]:
    """(accepted rounds, rounds) per slot of a recorded entry; none when it is missing or damaged."""
    try:
        accepted, rounds = [float(a) for a in entry["accepted"]], [float(n) for n in entry["rounds"]]
    except (TypeError, KeyError, ValueError):
        return [], []
    ok = len(accepted) == len(rounds) and all(0 <= a <= n for a, n in zip(accepted, rounds))
    return (accepted, rounds) if ok else ([], [])


def _added_acceptance(entry, rates: list[float], rounds: int) -> dict:
    accepted, weights = _acceptance_totals(entry)
    pad = max(0, len(rates) - len(accepted))
    accepted, weights = accepted + [0.0] * pad, weights + [0.0] * pad
    for i, r in enumerate(rates):
        accepted[i], weights[i] = _add(accepted[i], weights[i], r * rounds, rounds)
    return {"accepted": accepted, "rounds": weights}


def _batch_entries(entries) -> dict[tuple[int, int], dict]:
    """(batch size, k) -> {"steps", "rounds"} of a recorded entry; parts damaged by hand are left out."""
    out = {}
    for name, e in entries.items() if isinstance(entries, dict) else ():
        try:
            b, k = map(int, name.split(","))
            if e["rounds"] > 0 and e["steps"] >= 0:
                out[b, k] = {"steps": float(e["steps"]), "rounds": float(e["rounds"])}
        except (ValueError, TypeError, KeyError):
            continue
    return out


@functools.cache
def code_fingerprint() -> str:
    h = hashlib.sha256()
    for d in TIMED_CODE:  # its subfolders too (decoding/engine, ...); .cc: the CPU kernels
        for f in sorted(p for p in d.rglob("*") if p.suffix in (".py", ".cc")):
            h.update(str(f.relative_to(d)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _hashed(parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _model(model: LoadedTarget) -> str:
    """The target as its checkpoint describes it: in the decoding layout (modeling/target.py, `decoding_params`) it is
    the same model, so its records are the same."""
    return repr(dataclasses.replace(model.cfg, unroll_layers=False, fuse_projections=False, pack_weights=False))


def _cost_key(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int, budgets=None) -> str:
    """The setup a cost was measured in; budgets: (k, the verify budgets) of budget rounds' costs, None of steps'."""
    dev = jax.devices()[0]
    # the layout too (model.cfg as it decodes): the packed CPU layout and XLA's matmuls cost differently
    extra = [] if budgets is None else [budgets[0], sorted(budgets[1])]
    return _hashed([dev.platform, dev.device_kind, jax.__version__, repr(model.cfg), repr(drafter.cfg), batch_size,
                    cache_len, code_fingerprint()] + extra)


def _drafter_key(model: LoadedTarget, drafter: LoadedDrafter, sampled: bool) -> str:
    weights, vocab = drafter.params.weights, drafter.params.vocab
    digest = lambda x: hashlib.sha256(jax.device_get(x).tobytes()).hexdigest()
    return _hashed([_model(model), repr(drafter.cfg), drafter.meta.get("eval"), sampled,
                    digest(jax.tree.leaves(weights)[0])] + ([digest(vocab)] if vocab is not None else []))
