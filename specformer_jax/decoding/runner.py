"""Running the decoding loops: a typed plan of what one loop compiles, the compile cache, batch padding, the batches
of a call and the stats they add up to. `generate` (api.py) and the timing harness (timing.py) run loops here."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.autoregressive import ar_generate
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.decoding.speculative import spec_generate, specformer_drafts
from specformer_jax.parallel import batch_sharded

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this many tokens, so nearby lengths share a compilation


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static options of one decoding loop: a change in any of them is another compilation."""

    cfg: TargetConfig
    eos_ids: tuple[int, ...]
    sampling: SamplingConfig
    max_new_tokens: int
    drafter: DrafterConfig | None = None  # None: plain decoding
    draft_len: int = 0  # drafts per round k (1..drafter.num_slots) when speculative

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.draft_len > 0

    @property
    def precision(self) -> str | None:
        """float32 models decode with float32 matmuls everywhere. GPUs would otherwise round them to TF32 and TPUs
        to bfloat16 passes; a verify forward over k + 1 tokens and a one-token step are then rounded differently,
        near-ties of the greedy argmax flip, and speculative output drifts from plain output."""
        return "highest" if self.cfg.dtype == "float32" else None

    def loop(self) -> Callable:
        """The jittable loop: (params[, drafter params], prompts, lengths, budgets, row keys) -> outputs."""
        common = dict(cfg=self.cfg, sampling=self.sampling, eos_ids=self.eos_ids, max_new_tokens=self.max_new_tokens)
        if not self.speculative:
            def plain(params, prompts, lens, budget, keys):
                out, num_out, steps = ar_generate(params, prompts, lens, budget, keys, **common)
                return {"out": out, "num_out": num_out, "steps": steps}
            return plain
        hooks = self.drafter.resolved_hooks(self.cfg)
        draft_fn = specformer_drafts(self.cfg, self.drafter, self.draft_len)

        def speculative(params, dparams, prompts, lens, budget, keys):
            s = spec_generate(params, dparams, prompts, lens, budget, keys, hooks=hooks, draft_fn=draft_fn,
                              num_slots=self.draft_len, **common)
            return {"out": s.out, "num_out": s.num_out, "steps": s.rounds, "row_rounds": s.row_rounds,
                    "row_emitted": s.row_emitted, "accepted": s.accepted}
        return speculative


def make_plan(model: LoadedTarget, drafter: LoadedDrafter | None, draft_len: int, sampling: SamplingConfig,
              max_new_tokens: int) -> DecodePlan:
    """Plain decoding when there is no drafter or draft_len is 0, else speculative with draft_len drafts."""
    speculative = drafter is not None and draft_len > 0
    return DecodePlan(model.cfg, model.eos_ids, sampling, max_new_tokens, drafter.cfg if speculative else None,
                      draft_len if speculative else 0)


class CompiledLoops:
    """Ahead-of-time compiled loops keyed by plan, batch shape and mesh, so compile time is measured apart and a
    second call with the same shapes starts at once. One per process (`COMPILED`)."""

    def __init__(self):
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, plan: DecodePlan, mesh: Mesh | None, args) -> tuple[Callable, float]:
        """(compiled loop, seconds spent compiling it now: 0 when it was compiled before)."""
        key = (plan, args[-4].shape, mesh)  # args end with (prompts, lengths, budgets, keys)
        if key in self._cache:
            return self._cache[key], 0.0
        t = time.perf_counter()
        with jax.default_matmul_precision(plan.precision) if plan.precision else contextlib.nullcontext():
            compiled = jax.jit(plan.loop()).lower(*args).compile()
        self._cache[key] = compiled
        return compiled, time.perf_counter() - t


COMPILED = CompiledLoops()


def pad_batch(chunk: list[list[int]], batch_size: int, max_new_tokens: int):
    """Right-padded prompts int32[B, Tp] (Tp: a multiple of PROMPT_BUCKET), lengths, budgets. Rows past the chunk
    are inactive padding (budget 0), so a short last chunk reuses the batch-B compilation."""
    Tp = -(-max(len(p) for p in chunk) // PROMPT_BUCKET) * PROMPT_BUCKET
    prompts = np.zeros((batch_size, Tp), np.int32)
    lens = np.ones((batch_size,), np.int32)
    budget = np.zeros((batch_size,), np.int32)
    for r, p in enumerate(chunk):
        prompts[r, : len(p)] = p
        lens[r] = len(p)
        budget[r] = max_new_tokens
    return jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(budget)


@dataclasses.dataclass
class DecodeRun:
    """What the batches of one call produced and measured."""

    token_ids: list[list[int]]  # generated ids per prompt, EOS included when it was produced
    compile_seconds: float
    run_seconds: float
    steps: int  # loop iterations: plain steps or speculative rounds (the prefill, which emits a token, not counted)
    plain_steps: int  # the steps plain decoding needs for the same tokens: each batch's longest row
    rows: dict[str, list]  # speculative only: per row "row_rounds", "row_emitted", "accepted" [k]

    def stats(self) -> dict:
        """Counts and times of the run."""
        num_generated = sum(map(len, self.token_ids))
        return {"num_prompts": len(self.token_ids), "num_generated": num_generated,
                "tokens_per_second": num_generated / self.run_seconds if self.run_seconds else 0.0,
                "run_seconds": self.run_seconds, "compile_seconds": self.compile_seconds, "decode_steps": self.steps}

    def speculative_stats(self) -> dict:
        """Acceptance of a speculative run (empty for plain decoding), the batch's accepted length included."""
        if not self.rows:
            return {}
        return {**_speculative_stats(self.rows), "batch_accepted_length": self.plain_steps / max(self.steps, 1)}


def _speculative_stats(rows: dict[str, list]) -> dict:
    """mean_accepted_length (tokens per target forward, bonus included), per-slot acceptance, rounds: total and per
    row."""
    rounds = np.asarray(rows["row_rounds"], np.int64)
    emitted = np.asarray(rows["row_emitted"], np.int64)
    accepted = np.asarray(rows["accepted"], np.int64)
    total = max(int(rounds.sum()), 1)
    return {
        "rounds": int(rounds.sum()),
        "mean_accepted_length": float(emitted.sum() / total),
        "acceptance_rate_per_slot": (accepted.sum(0) / total).tolist(),
        "per_row": {"rounds": rounds.tolist(), "mean_accepted_length": (emitted / np.maximum(rounds, 1)).tolist()},
    }


def run_batches(plan: DecodePlan, params, dparams, ids: list[list[int]], batch_size: int, row_keys: jax.Array,
                mesh: Mesh | None = None, on_batch: Callable[[int], None] = lambda done: None) -> DecodeRun:
    """Decode every prompt of `ids` in batches of `batch_size` rows (the last one padded with inactive rows);
    row_keys: one PRNG key per prompt. `params` (and `dparams`) already placed on `mesh` when one is given."""
    run = DecodeRun([], 0.0, 0.0, 0, 0, {})
    for start in range(0, len(ids), batch_size):
        chunk = ids[start : start + batch_size]
        keys = row_keys[start : start + len(chunk)]
        keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (batch_size - len(chunk),))])
        batch = (*pad_batch(chunk, batch_size, plan.max_new_tokens), keys)
        if mesh is not None:
            batch = jax.device_put(batch, batch_sharded(mesh))
        args = (params, dparams, *batch) if plan.speculative else (params, *batch)
        compiled, seconds = COMPILED.get(plan, mesh, args)
        t = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        _add_batch(run, result, len(chunk), time.perf_counter() - t, seconds)
        on_batch(len(run.token_ids))
    return run


def _add_batch(run: DecodeRun, result: dict, n: int, run_seconds: float, compile_seconds: float) -> None:
    """Fold one batch's outputs (its first n rows are real) into `run`."""
    out, num_out = np.asarray(result["out"]), np.asarray(result["num_out"])
    run.token_ids += [out[r, : num_out[r]].tolist() for r in range(n)]
    run.run_seconds += run_seconds
    run.compile_seconds += compile_seconds
    run.steps += int(result["steps"])
    run.plain_steps += max(int(num_out.max()) - 1, 0)  # the prefill emits each row's first token
    for name in ("row_rounds", "row_emitted", "accepted"):
        if name in result:
            run.rows.setdefault(name, []).extend(np.asarray(result[name])[:n])
