"""The server's engine: one thread that owns the device and runs the decoding engine (decoding/engine/) on requests
that arrive while it runs.

Requests wait in a queue and take free slots at the next chunk boundary, so a new request joins rows that are
mid-answer (continuous batching); tokens go to their request's callback as chunks end; an abandoned request (its
client gone, or a stop string seen) frees its slot at the next boundary. The sampling settings are static in a
compiled plan, so requests are grouped by them: each group is a pool of its own, made when a request needs it and
dropped when it empties, and at most `slots` requests are live across the groups.

Each chunk verifies as many drafts as pay for the rows live in its pool now (`ServeConfig.chunk_round`: the
measured default round for that many rows, decoding/tuning/draft_len.py, as `generate` runs it for a batch of that
size: k drafts a row, or a verify budget of positions where the defaults measured one), and none when they do not
pay: then the rounds are plain steps that skip the drafter (chunk.run_plain_chunk), so a busy server costs what
plain decoding does.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.drafts import kinds
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.engine.scheduler import Engine
from specformer_jax.decoding.tuning.draft_len import (
    checked_verify_budget,
    default_round,
    hybrid_model_len,
)
from specformer_jax.errors import SpecformerError
from specformer_jax.serving.metrics import ServerMetrics

MIN_BUCKET = 32
COMPILE_AHEAD_PROMPT = 256  # prompts up to this many tokens prefill without a compilation once compile_ahead ran


class QueueFull(SpecformerError):
    """The queue holds --max-queue requests: the request is refused at once (HTTP 503)."""


@dataclasses.dataclass
class Request:
    """One request as the engine sees it. on_tokens(new token ids) and on_finish(reason: "stop" (EOS), "length",
    "abandoned" or "error: ...") are called from the engine thread."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int | None
    on_tokens: Callable[[list[int]], None]
    on_finish: Callable[[str], None]
    abandoned: bool = False
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    emitted: int = 0


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the engine serves with: `slots` requests live at once, `context` positions per request (prompt and
    answer), `draft_len` drafts per round (None: per chunk, what pays for the rows live; an int: always that many),
    `chunk_rounds` rounds between two looks of the host, `max_queue` requests waiting at most."""

    slots: int
    context: int
    draft_len: int | None
    chunk_rounds: int
    max_queue: int

    def chunk_round(self, drafter, live: int, packed: bool) -> tuple[int, int]:
        """(drafts a row that a chunk verifies with `live` rows in its pool, 0 for plain steps; positions a round
        verifies, 0 for every row's drafts). With no draft length asked for, the measured default round for that
        many rows: a budget where defaults.CPU_VERIFY_BUDGETS lists one, else the default draft length whole."""
        if drafter is None:
            return 0, 0
        if self.draft_len is not None:
            return self.draft_len, 0
        return default_round(drafter, live, packed)


class _Group:
    """The pool of the requests that share one sampling config."""

    def __init__(self, model, drafter, sampling: SamplingConfig, cfg: ServeConfig, mesh):
        widest = max(cfg.chunk_round(drafter, n, model.cfg.pack_weights)[0] for n in range(1, cfg.slots + 1))
        self.plan = make_plan(model, widest, sampling, cfg.context)
        model_len = hybrid_model_len(drafter, 1, model.cfg)
        source = kinds.draft_source(drafter, mesh, model.cfg, model_len) if widest else None
        self.engine = Engine(self.plan, model.params, source, Verify(), cfg.chunk_rounds, cfg.slots,
                             cfg.context + widest + 1, mesh)
        self.slot_req: list[Request | None] = [None] * cfg.slots
        self.sent = [0] * cfg.slots

    def live(self) -> int:
        return sum(r is not None for r in self.slot_req)

    def compact(self) -> int:
        """The rows the next chunk runs over: the power of two that covers the last live row, unless that is more
        than twice the live count's: then the live rows past the live count's power of two are moved below it
        (pool.move_rows copies a row's caches, so rows move only when it saves a pool's worth of rows)."""
        live = [s for s, r in enumerate(self.slot_req) if r is not None]
        pow2 = lambda n: min(1 << (n - 1).bit_length(), len(self.slot_req))
        n, covering = pow2(len(live)), pow2(live[-1] + 1)
        if covering <= 2 * n:
            return covering
        past = [s for s in live if s >= n]
        if past:
            into = [s for s in range(n) if self.slot_req[s] is None][: len(past)]
            self.engine.move(past, into)
            for s, d in zip(past, into):
                self.slot_req[d], self.sent[d], self.slot_req[s], self.sent[s] = self.slot_req[s], self.sent[s], None, 0
        return n

    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.slot_req) if r is None]


class ServingEngine:
    """Requests in (`submit`, from any thread), tokens out through their callbacks; `stop` ends the thread."""

    def __init__(self, model, drafter, cfg: ServeConfig, mesh=None):
        """mesh: rows sharded over its batch axes (slots rounded up to a multiple of them), the model over the rest."""
        if model.cfg.max_position < cfg.context:
            raise SpecformerError(f"--context {cfg.context} is past the model's context length "
                                  f"({model.cfg.max_position})")
        if mesh is not None:
            rows = mesh.shape["data"] * mesh.shape["fsdp"]
            cfg = dataclasses.replace(cfg, slots=-(-cfg.slots // rows) * rows)
        model.use_decoding_layout(cfg.slots, mesh)
        self.model, self.drafter, self.cfg, self.mesh = model, drafter, cfg, mesh
        self.metrics = ServerMetrics(cfg.slots)
        self.error: str | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._groups: dict[SamplingConfig, _Group] = {}
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specformer-engine", daemon=True)

    def compile_ahead(self, progress=lambda done, total: None) -> None:
        """Compile, before serving, what a greedy pool may run, so no request waits for a compilation: the chunk of
        every round (drafts a row, budget) the live rows can ask for over every number of rows a chunk can run over,
        the prefill of blocks of 1..slots prompts of up to COMPILE_AHEAD_PROMPT tokens, and the moves of rows. Other
        sampling settings, and longer prompts, compile when first asked for. Call before `start`."""
        group = self._groups.setdefault(SamplingConfig(), _Group(self.model, self.drafter, SamplingConfig(),
                                                                 self.cfg, self.mesh))
        P, k = self.cfg.slots, group.plan.draft_len
        counts = [1 << i for i in range(P.bit_length()) if 1 << i < P] + [P]  # what Engine.fill, compact use
        lens = [n for n in (32, 64, 128, 256) if n <= min(self.cfg.context, COMPILE_AHEAD_PROMPT)]
        jobs = [(group.engine.chunk_function, (width, rows, b)) for rows in counts
                for w, b in sorted({self._round(group, n, rows) for n in range(1, rows + 1)})
                for width in (group.engine.widths if w == k else (w,))]  # at k: whichever its live rows need
        jobs += [(group.engine.compile_fill, (b, n)) for b in counts for n in lens]
        jobs += [(group.engine.move, ([P] * m, [P] * m)) for m in counts[:-1]]  # moves nothing: compiles
        for i, (fn, args) in enumerate(jobs):
            fn(*args)
            progress(i + 1, len(jobs))
        self.metrics.compile_seconds += group.engine.compile_seconds

    def start(self) -> "ServingEngine":
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, req: Request) -> None:
        """Queue a request; QueueFull when --max-queue are waiting, SpecformerError when the engine has stopped."""
        with self._cv:
            if not self.alive():
                raise SpecformerError(f"the engine has stopped{': ' + self.error if self.error else ''}")
            if len(self._queue) >= self.cfg.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(f"the queue is full ({self.cfg.max_queue} requests waiting): retry later")
            self._queue.append(req)
            self.metrics.queued = len(self._queue)
            self._cv.notify()

    def abandon(self, req: Request) -> None:
        """The request's client has gone (or needs no more tokens): its slot is freed at the next chunk boundary."""
        with self._cv:
            req.abandoned = True
            self._cv.notify()

    def stop(self, timeout: float = 60.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._stopping or self._queue or self._live())
                    if self._stopping:
                        break
                    taken = self._take()
                self._step(taken)
        except Exception as e:  # noqa: BLE001 -- the engine thread must tell every request, not die silently
            self.error = f"{type(e).__name__}: {e}"
            for req in self._all_requests():
                req.on_finish(f"error: {self.error}")
            raise
        finally:
            for req in self._all_requests():
                req.on_finish("abandoned")

    def _live(self) -> int:
        return sum(g.live() for g in self._groups.values())

    def _all_requests(self) -> list[Request]:
        reqs = [r for g in self._groups.values() for r in g.slot_req if r is not None] + list(self._queue)
        self._queue.clear()
        self._groups.clear()
        return reqs

    def _take(self) -> list[Request]:
        """Requests leaving the queue for free slots (in arrival order; the abandoned ones dropped)."""
        room = self.cfg.slots - self._live()
        taken = []
        while self._queue and len(taken) < room:
            req = self._queue.popleft()
            if req.abandoned:
                req.on_finish("abandoned")
            else:
                taken.append(req)
        self.metrics.queued = len(self._queue)
        return taken

    def _step(self, taken: list[Request]) -> None:
        """Insert the taken requests, then run one chunk on every pool with live rows and hand out its tokens."""
        compiled = sum(g.engine.compile_seconds for g in self._groups.values())
        for sampling in dict.fromkeys(r.sampling for r in taken):
            if sampling not in self._groups:
                compiled -= self._drop_idle_groups()
                self._groups[sampling] = _Group(self.model, self.drafter, sampling, self.cfg, self.mesh)
            self._insert(self._groups[sampling], [r for r in taken if r.sampling == sampling])
        for group in self._groups.values():
            self._drop_abandoned(group)
            if group.live():
                self._chunk(group)
        self.metrics.compile_seconds += sum(g.engine.compile_seconds for g in self._groups.values()) - compiled
        self.metrics.busy = self._live()

    def _drop_idle_groups(self) -> float:
        """Drop the pools with no live row (their memory goes; their compiled functions stay in runner.COMPILED),
        before another sampling setting makes one: an idle pool is kept until then, so that requests one after
        another do not each make a pool. Returns the dropped pools' compile seconds."""
        idle = [s for s, g in self._groups.items() if not g.live()]
        seconds = sum(self._groups[s].engine.compile_seconds for s in idle)
        for s in idle:
            del self._groups[s]
        return seconds

    def _insert(self, group: _Group, reqs: list[Request]) -> None:
        slots = group.free()[: len(reqs)]
        for r, s in zip(reqs, slots):
            group.slot_req[s], group.sent[s] = r, 0
        keys = jax.numpy.stack([_request_key(r.seed) for r in reqs])
        context = self.cfg.context
        group.engine.fill([r.ids for r in reqs], [r.max_tokens for r in reqs], keys, slots,
                          bucket_of=lambda n: min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), context))

    def _drop_abandoned(self, group: _Group) -> None:
        gone = [s for s, r in enumerate(group.slot_req) if r is not None and r.abandoned]
        if gone:
            group.engine.cancel(gone)
            for s in gone:
                req, group.slot_req[s] = group.slot_req[s], None
                self.metrics.finish(req, "abandoned")
                req.on_finish("abandoned")

    def _round(self, group: _Group, live: int, rows: int) -> tuple[int, int]:
        """(drafts a row, positions a round; 0: every row's drafts) of a chunk over `rows` rows of which `live` are
        live: `ServeConfig.chunk_round`, the budget raised to the rows (only live rows take positions) and held to
        the chunk's positions as `generate`'s is (`checked_verify_budget`)."""
        width, budget = self.cfg.chunk_round(self.drafter, live, self.model.cfg.pack_weights)
        width = min(width, group.plan.draft_len)
        return width, checked_verify_budget(max(budget, rows) if budget else 0, width, rows)

    def _chunk(self, group: _Group) -> None:
        """One chunk on the group's pool, at the round that pays for its live rows; tokens out, finished rows
        collected."""
        live = group.live()
        rows = group.compact()
        width, budget = self._round(group, live, rows)
        done, num_out = group.engine.chunk(None if width == group.plan.draft_len else width, rows, budget)
        self.metrics.chunks[width, budget] += 1
        pool = group.engine.pool
        out = np.asarray(pool.out)
        ended = []
        now = time.perf_counter()
        for s, req in enumerate(group.slot_req):
            if req is None:
                continue
            if num_out[s] > group.sent[s]:
                new = out[s, group.sent[s]: num_out[s]].tolist()
                group.sent[s] = int(num_out[s])
                if req.first_token is None:
                    req.first_token = now
                req.emitted += len(new)
                if not req.abandoned:
                    req.on_tokens(new)
            if done[s]:
                ended.append(s)
        if ended:
            self._collect(group, ended, out, num_out)

    def _collect(self, group: _Group, ended: list[int], out, num_out) -> None:
        rounds, emitted = (np.asarray(x) for x in jax.device_get((group.engine.pool.row_rounds,
                                                                  group.engine.pool.row_emitted)))
        for s in ended:
            req, group.slot_req[s] = group.slot_req[s], None
            last = int(out[s, num_out[s] - 1]) if num_out[s] else -1
            reason = "abandoned" if req.abandoned else "stop" if last in self.model.eos_ids else "length"
            if group.plan.speculative:
                self.metrics.add_rounds(int(rounds[s]), int(emitted[s]))
            self.metrics.finish(req, reason)
            req.on_finish(reason)


def _request_key(seed: int | None) -> jax.Array:
    """The request's PRNG key: `generate`'s for its first prompt under this seed (a random seed when none)."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    return jax.random.fold_in(jax.random.key(seed), 0)


def chat_ids(model, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the assistant's answer."""
    tok = model.tokenizer
    if tok is None or not tok.chat_template:
        raise SpecformerError(f"{model.source} has no chat template: use /v1/completions")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)
