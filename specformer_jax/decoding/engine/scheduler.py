"""The host side of the engine: a queue of requests, a pool of slots on the device, and chunks of rounds.

Between chunks the host reads each slot's `done` flag and token count (a few bytes), collects the requests that
finished, and refills free slots from the queue with one jitted prefill of the waiting prompts:

  continuous  free slots are refilled after every chunk, so no request waits for a slower neighbour
  static      the next batch is inserted only when every slot is free (a batch runs until its slowest row is done)

`decode_requests` is a generator: with stream=True it yields (request index, new token ids) at chunk boundaries;
its return value is the DecodeRun. Ctrl-C stops it at the next chunk boundary (`Interrupted`).
"""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.engine import runner
from specformer_jax.decoding.engine.bound import BOUND
from specformer_jax.decoding.engine.budget import Sizes, budget_sizes
from specformer_jax.decoding.engine.chunk import (
    chunk_widths,
    needed_width,
    run_budget_chunk,
    run_chunk,
    run_first_rows,
    run_plain_chunk,
)
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.pool import Pool, cache_len, cancel_rows, empty_pool, insert, move_rows
from specformer_jax.decoding.engine.runner import ORIGIN_COUNTS, DecodeRun
from specformer_jax.defaults import CHUNK_ROUNDS
from specformer_jax.parallel import decode_state_shardings, replicated

SCHEDULES = ("continuous", "static")
PROMPT_BUCKET = 16  # prompt blocks are padded to a multiple of this many tokens, so nearby lengths share a compilation


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped decoding at a chunk boundary; `finished` of `total` requests were complete."""

    def __init__(self, finished: int, total: int):
        super().__init__(f"stopped at a chunk boundary: {finished} of {total} requests finished")
        self.finished, self.total = finished, total


def bucket(n: int, size: int = PROMPT_BUCKET) -> int:
    return -(-n // size) * size


class Engine:
    """The compiled functions of one plan, draft source, acceptance rule, pool size and mesh, and the device state
    they pass along."""

    def __init__(self, plan: DecodePlan, params, source, accept, rounds: int, pool_size: int, max_len: int, mesh,
                 budget: int | Sizes = 0):
        source = BOUND.get(source, plan, params) if plan.speculative else None  # not in every chunk
        self.plan, self.params, self.source, self.accept, self.rounds, self.mesh = (plan, params, source, accept,
                                                                                  rounds, mesh)
        self.budget = budget_sizes(budget) if plan.speculative else ()  # engine/budget.py; (): all drafts
        self.widths = chunk_widths(plan, source)
        self.width = self.widths[-1]  # of the next chunk
        self.compile_seconds = 0.0
        self.shardings = None if mesh is None else decode_state_shardings(
            jax.eval_shape(lambda: empty_pool(plan, pool_size, max_len, source)), mesh)
        self.pool: Pool = self._compiled(empty_pool, (source,), static=(pool_size, max_len))(source)

    def _compiled(self, fn, args, static=(), donate=()):
        compiled, seconds = runner.COMPILED.get(fn, self.plan, args, static=static, mesh=self.mesh, donate=donate,
                                                out_shardings=self.shardings)
        self.compile_seconds += seconds
        return compiled

    def insert(self, prompts, lens, slots, budget, keys) -> None:
        block = (prompts, lens, slots, budget)
        block = tuple(jnp.asarray(x) for x in block) + (keys,)
        if self.mesh is not None:
            block = jax.device_put(block, replicated(self.mesh))
        args = (self.params, self.source, self.pool, *block)
        self.pool = self._compiled(insert, args, donate=(2,))(*args)

    def chunk_function(self, width: int | None = None, rows: int | None = None, budget: int | Sizes | None = None):
        """(the compiled chunk `chunk` runs for these arguments, its arguments): compiled now if it was not."""
        args = (self.params, self.source, self.accept, self.pool)
        width = self.width if width is None else width
        budget = (self.budget if budget is None else budget_sizes(budget)) if width else ()
        if rows is not None and rows < self.pool.done.shape[0]:
            static = (self.rounds, width, rows, budget)
            return self._compiled(run_first_rows, args, static=static, donate=(3,)), args
        if width == 0 and self.plan.speculative:
            return self._compiled(run_plain_chunk, args, static=(self.rounds,), donate=(3,)), args
        if budget:
            return self._compiled(run_budget_chunk, args, static=(self.rounds, width, budget), donate=(3,)), args
        return self._compiled(run_chunk, args, static=(self.rounds, width), donate=(3,)), args

    def compile_fill(self, rows: int, prompt_len: int) -> None:
        """Compile the prefill of a block of `rows` prompts padded to `prompt_len` tokens (`fill`), running nothing."""
        block = tuple(jnp.zeros((rows, prompt_len) if i == 0 else (rows,), jnp.int32) for i in range(4))
        keys = jax.random.split(jax.random.key(0), rows)
        if self.mesh is not None:
            block, keys = jax.device_put((block, keys), replicated(self.mesh))
        self._compiled(insert, (self.params, self.source, self.pool, *block, keys), donate=(2,))

    def fill(self, prompts: list[list[int]], budgets: list[int], keys: jax.Array, slots: list[int],
             bucket_of=None) -> None:
        """Prefill `prompts` (token ids; new-token budgets, PRNG keys in the same order) into pool rows `slots`, as
        one block of b rows (b: a power of two, so few shapes compile; padding rows point past the pool and are
        dropped). bucket_of(longest prompt): the padded prompt length (default `bucket`)."""
        P = self.pool.done.shape[0]
        b = min(1 << (len(prompts) - 1).bit_length(), P)
        block = np.zeros((b, (bucket_of or bucket)(max(map(len, prompts)))), np.int32)
        lens, rows, budget = np.ones((b,), np.int32), np.full((b,), P, np.int32), np.zeros((b,), np.int32)
        for row, (ids, n, s) in enumerate(zip(prompts, budgets, slots)):
            block[row, : len(ids)] = ids
            lens[row], rows[row], budget[row] = len(ids), s, n
        pad = jnp.concatenate([keys, jnp.repeat(keys[:1], b - len(prompts), axis=0)]) if b > len(prompts) else keys
        self.insert(block, lens, rows, budget, pad)

    def move(self, src: list[int], dst: list[int]) -> None:
        """Rows `src` moved into the free rows `dst` (pool.move_rows), as a power of two of moves (the padding
        points past the pool: dropped), so few shapes compile."""
        P, m = self.pool.done.shape[0], 1 << (len(src) - 1).bit_length()
        src, dst = (jnp.asarray(x + [P] * (m - len(x)), jnp.int32) for x in (src, dst))
        if self.mesh is not None:
            src, dst = jax.device_put((src, dst), replicated(self.mesh))
        args = (self.pool, src, dst)
        self.pool = self._compiled(move_rows, args, donate=(0,))(*args)

    def cancel(self, slots: list[int]) -> None:
        """Mark rows `slots` done (their requests abandoned): they change nothing from the next round on."""
        slots = jnp.asarray(slots, jnp.int32)
        args = (self.pool, slots if self.mesh is None else jax.device_put(slots, replicated(self.mesh)))
        self.pool = self._compiled(cancel_rows, args, donate=(0,))(*args)

    def chunk(self, width: int | None = None, rows: int | None = None,
              budget: int | Sizes | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Run a chunk; returns each slot's done flag and token count, and sets the width of the next chunk to the
        one its live rows need (chunk.py: `run_chunk`). width: verify this many drafts instead (at most the plan's;
        0 on a speculative pool: plain steps that do not draft, `run_plain_chunk`); rows: over the pool's first
        rows only (`run_first_rows`; the others must be done); budget: positions a round verifies instead of the
        engine's (0: every row's drafts)."""
        fn, args = self.chunk_function(width, rows, budget)
        self.pool = fn(*args)
        if len(self.widths) == 1 or width is not None:
            return jax.device_get((self.pool.done, self.pool.num_out))
        done, num_out, origin = jax.device_get((self.pool.done, self.pool.num_out, self.pool.origin))
        self.width = int(needed_width(self.plan, self.source, done, origin))
        return done, num_out


def decode_requests(plan: DecodePlan, params, source, ids: list[list[int]], pool_size: int, keys: jax.Array, *,
                    accept=Verify(), chunk_rounds: int = CHUNK_ROUNDS, schedule: str = "continuous", mesh=None,
                    stream: bool = False, budgets: list[int] | None = None, verify_budget: int | Sizes = 0,
                    on_finished=lambda done: None) -> Iterator[tuple[int, list[int]]]:
    """Decode every request of `ids` (prompt token ids) on a pool of `pool_size` slots; source: the draft source of
    a speculative plan (draft_source.py), else None; accept: the acceptance rule (speculative.Verify, or
    set_acceptance.SetAcceptance to measure costs); keys: one PRNG key per request; budgets: new tokens per request
    (default: plan.max_new_tokens, also the most allowed); chunk_rounds: rounds per chunk. Yields (request index,
    new tokens) at chunk boundaries when `stream`; returns the DecodeRun. on_finished(number of requests done) is
    called when requests finish. verify_budget: positions each speculative round verifies, at least pool_size
    (engine/budget.py: every live row's last token and the most valuable drafts), or sizes of budget with their
    costs, one chosen each round (`best_size`); 0: every row's drafts."""
    budgets = [plan.max_new_tokens] * len(ids) if budgets is None else [min(b, plan.max_new_tokens) for b in budgets]
    max_len = cache_len(plan, bucket(max(map(len, ids))))
    start = time.perf_counter()  # before the pool compiles: every compilation counted lies inside the run
    engine = Engine(plan, params, source, accept, chunk_rounds, pool_size, max_len, mesh, verify_budget)
    run = DecodeRun([[] for _ in ids], [0.0] * len(ids), pool_size=pool_size,
                    plain_steps=0 if schedule == "static" else None,
                    origins=tuple(source.origins) if plan.speculative else ())
    queue = collections.deque(range(len(ids)))
    slot_req = [-1] * pool_size  # the request each slot holds
    sent = [0] * pool_size  # tokens of each slot's request already streamed
    paused, finished, longest = 0.0, 0, 0
    with _stop_flag() as stop:
        while queue or max(slot_req) >= 0:
            if stop.is_set():
                raise Interrupted(finished, len(ids))
            free = [s for s in range(pool_size) if slot_req[s] < 0]
            if queue and free and (schedule == "continuous" or len(free) == pool_size):
                taken = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                _refill(engine, ids, budgets, keys, taken, free, slot_req)
            done, num_out = engine.chunk()
            if stream:
                t = time.perf_counter()
                yield from _new_tokens(engine.pool, slot_req, sent, num_out)
                paused += time.perf_counter() - t
            ended = [s for s in range(pool_size) if slot_req[s] >= 0 and done[s]]
            if ended:
                longest = max([longest] + [int(num_out[s]) for s in ended])
                seconds = time.perf_counter() - start - paused - engine.compile_seconds
                _collect(engine.pool, ended, slot_req, sent, num_out, run, seconds)
                finished += len(ended)
                on_finished(finished)
            if run.plain_steps is not None and max(slot_req) < 0:  # a static batch ended: plain decoding would
                run.plain_steps += max(longest - 1, 0)  # take its longest answer's steps (the prefill emits one)
                longest = 0
    run.steps, run.rounds_run = int(engine.pool.rounds), int(engine.pool.rounds_run)
    run.compile_seconds = engine.compile_seconds
    run.run_seconds = time.perf_counter() - start - paused - engine.compile_seconds
    run.rows = {name: [per[r] for r in sorted(per)] for name, per in run.rows.items()}
    return run


def run_to_end(events):
    """The return value of a decode_requests generator (or of one that wraps it), its events dropped."""
    while True:
        try:
            next(events)
        except StopIteration as end:
            return end.value


def _refill(engine: Engine, ids, budgets, keys, taken: list[int], free: list[int], slot_req: list[int]) -> None:
    """Prefill the `taken` requests into the first free slots (`Engine.fill`)."""
    for r, s in zip(taken, free):
        slot_req[s] = r
    engine.fill([ids[r] for r in taken], [budgets[r] for r in taken], keys[np.asarray(taken)], free[: len(taken)])


def _new_tokens(pool: Pool, slot_req, sent, num_out):
    """(request, tokens emitted since the last yield) for every slot that emitted some."""
    out = np.asarray(pool.out)
    for s, r in enumerate(slot_req):
        if r >= 0 and num_out[s] > sent[s]:
            yield r, out[s, sent[s]: num_out[s]].tolist()
            sent[s] = int(num_out[s])


def _collect(pool: Pool, ended: list[int], slot_req, sent, num_out, run: DecodeRun, seconds: float) -> None:
    """Copy the finished requests' tokens and counts to the host and free their slots. The pool's small arrays come
    over whole in one transfer and are indexed on the host: indexing them on the device would dispatch a gather per
    array for every chunk in which a request ends."""
    speculative = pool.drafts.shape[1] > 0
    counts = ("row_rounds",) + (("row_emitted", "accepted", "verified", "bare_rounds") if speculative else ())
    counts += ORIGIN_COUNTS if speculative and pool.origin_rounds.shape[1] > 1 else ()
    host = jax.device_get({name: getattr(pool, name) for name in ("out",) + counts})
    for s in ended:
        r = slot_req[s]
        run.token_ids[r] = host["out"][s, : num_out[s]].tolist()
        run.latency_seconds[r] = seconds
        run.live_row_rounds += int(host["row_rounds"][s])
        if speculative:
            for name in counts:
                run.rows.setdefault(name, {})[r] = np.array(host[name][s])  # a copy: the pool's buffers are reused
        slot_req[s], sent[s] = -1, 0


@contextlib.contextmanager
def _stop_flag():
    """A flag set by Ctrl-C while decoding (in the main thread; a second Ctrl-C interrupts at once)."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
