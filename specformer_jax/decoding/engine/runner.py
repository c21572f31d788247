"""What runs the engine's compiled functions and what a run adds up to: the compile cache (`COMPILED`), and
`DecodeRun`, the tokens, times and counts of one call with the stats derived from them."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np

from specformer_jax.decoding.engine.plan import DecodePlan


class CompiledFunctions:
    """Ahead-of-time compiled engine functions, each identified by the function, its static arguments (the plan
    first), the mesh and the shapes of its other arguments, so compile time is measured apart and a second call
    with the same shapes starts at once. One per process (`COMPILED`), holding the `capacity` most recently used
    (a long-lived process that decodes many models or shapes lets the old ones go)."""

    def __init__(self, capacity: int = 128):
        self.capacity = capacity
        self._cache: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def count(self, fn: Callable) -> int:
        """How many compilations of `fn` are held (for different plans, static arguments or shapes)."""
        return sum(key[0] is fn for key in self._cache)

    def get(self, fn: Callable, plan: DecodePlan, args: tuple, *, static: tuple = (), mesh=None,
            donate: tuple[int, ...] = (), out_shardings=None) -> tuple[Callable, float]:
        """(fn(plan, *static, *args) compiled for these args, seconds spent compiling it now: 0 when it was held)."""
        shapes = tuple((x.shape, x.dtype) for x in jax.tree.leaves(args))  # dtypes as they are: str() is slow
        key = (fn, plan, static, mesh, jax.tree.structure(args), shapes)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key], 0.0
        t = time.perf_counter()
        kw = {} if out_shardings is None else {"out_shardings": out_shardings}
        with jax.default_matmul_precision(plan.precision) if plan.precision else contextlib.nullcontext():
            compiled = jax.jit(functools.partial(fn, plan, *static), donate_argnums=donate, **kw).lower(
                *args).compile()
        self._cache[key] = compiled
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return compiled, time.perf_counter() - t


COMPILED = CompiledFunctions()


ORIGIN_COUNTS = ("origin_rounds", "origin_emitted", "origin_accepted")  # Pool's counts by where drafts came from


@dataclasses.dataclass
class DecodeRun:
    """What one call decoded and measured; per-request lists are in request order."""

    token_ids: list[list[int]]  # generated ids per request, EOS included when it was produced
    latency_seconds: list[float]  # per request: from the start of the run until the host collected it
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    steps: int = 0  # pool rounds run with a live row: plain steps or speculative rounds (prefills not counted)
    rounds_run: int = 0  # pool rounds run, the rounds after every row was done included
    plain_steps: int | None = None  # static schedule: the steps plain decoding needs for the same tokens
    live_row_rounds: int = 0  # rounds summed over requests: how full the pool ran
    pool_size: int = 0
    rows: dict[str, list] = dataclasses.field(default_factory=dict)  # speculative: "row_rounds", "row_emitted",
    # "accepted" [k], "verified", "bare_rounds" per request, and with several origins ORIGIN_COUNTS ([O], [O],
    # [O, k]) per request
    origins: tuple[str, ...] = ()  # the draft source's origins (draft_source.py)

    def stats(self) -> dict:
        """Counts and times of the run."""
        num_generated = sum(map(len, self.token_ids))
        lat = np.asarray(self.latency_seconds or [0.0])
        return {"num_prompts": len(self.token_ids), "num_generated": num_generated,
                "tokens_per_second": num_generated / self.run_seconds if self.run_seconds else 0.0,
                "requests_per_second": len(self.token_ids) / self.run_seconds if self.run_seconds else 0.0,
                "run_seconds": self.run_seconds, "compile_seconds": self.compile_seconds, "decode_steps": self.steps,
                "rounds_run": self.rounds_run,
                "pool_occupancy": self.live_row_rounds / max(self.rounds_run * self.pool_size, 1),
                "latency_seconds": {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)}}

    def speculative_stats(self) -> dict:
        """Acceptance of a speculative run (empty for plain decoding); the batch's accepted length on the static
        schedule, where a batch waits for its slowest row."""
        if not self.rows:
            return {}
        out = _speculative_stats(self.rows)
        if "origin_rounds" in self.rows:
            out["by_source"] = _origin_stats(self.rows, self.origins)
        if self.plain_steps is not None:
            out["batch_accepted_length"] = self.plain_steps / max(self.steps, 1)
        return out


def _speculative_stats(rows: dict[str, list]) -> dict:
    """mean_accepted_length (tokens per target forward, bonus included), per-slot acceptance, rounds: total and per
    request."""
    rounds = np.asarray(rows["row_rounds"], np.int64)
    emitted = np.asarray(rows["row_emitted"], np.int64)
    accepted = np.asarray(rows["accepted"], np.int64)
    verified = np.asarray(rows["verified"], np.int64)
    total = max(int(rounds.sum()), 1)
    return {
        "rounds": int(rounds.sum()),
        "mean_accepted_length": float(emitted.sum() / total),
        "acceptance_rate_per_slot": (accepted.sum(0) / total).tolist(),
        # a request's round verifies its last token and the drafts chosen for it (all k without a budget)
        "verified_positions_per_round": float(1 + verified.sum() / total),
        "accepted_per_verified_draft": float(accepted.sum() / max(int(verified.sum()), 1)),
        "rounds_without_drafts": float(np.asarray(rows["bare_rounds"], np.int64).sum() / total),
        "per_row": {"rounds": rounds.tolist(), "mean_accepted_length": (emitted / np.maximum(rounds, 1)).tolist()},
    }


def _origin_stats(rows: dict[str, list], origins: tuple[str, ...]) -> dict:
    """Per origin of the drafts (a hybrid's "specformer" and "ngram"): its share of the rounds, the tokens its
    rounds emitted on average, per-slot acceptance, and per request its rounds and accepted length."""
    rounds = np.asarray(rows["origin_rounds"], np.int64)  # [requests, O]
    emitted = np.asarray(rows["origin_emitted"], np.int64)
    accepted = np.asarray(rows["origin_accepted"], np.int64)  # [requests, O, k]
    total = max(int(rounds.sum()), 1)
    out = {}
    for o, name in enumerate(origins):
        r, n = rounds[:, o], max(int(rounds[:, o].sum()), 1)
        out[name] = {"rounds": int(r.sum()), "share_of_rounds": float(r.sum() / total),
                     "mean_accepted_length": float(emitted[:, o].sum() / n),
                     "acceptance_rate_per_slot": (accepted[:, o].sum(0) / n).tolist(),
                     "per_row": {"rounds": r.tolist(),
                                 "mean_accepted_length": (emitted[:, o] / np.maximum(r, 1)).tolist()}}
    return out
