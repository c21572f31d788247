"""What `GET /metrics` reports, in Prometheus' text format: requests by how they ended, tokens, the queue, busy
slots, speculation's accepted length, chunks by the drafts they verified, and latency histograms per request
(time to first token, the whole request, time per output token after the first)."""

from __future__ import annotations

import bisect
import collections
import time

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
PREFIX = "specformer"


class Histogram:
    """A cumulative histogram over fixed upper bounds, as Prometheus reads one."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """Counters the engine thread updates and the app reads (plain ints and floats: a read sees a recent value)."""

    def __init__(self, slots: int):
        self.slots, self.started = slots, time.time()
        self.queued = self.busy = self.rejected = self.invalid = 0
        self.finished: collections.Counter = collections.Counter()  # by reason: stop, length, abandoned, error
        self.prompt_tokens = self.completion_tokens = 0
        self.rounds = self.round_tokens = 0
        self.compile_seconds = 0.0
        self.chunks: collections.Counter = collections.Counter()  # by (drafts a row, verify budget; 0: none)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.per_token = Histogram(TOKEN_GAP_BUCKETS)

    def add_rounds(self, rounds: int, emitted: int) -> None:
        self.rounds += rounds
        self.round_tokens += emitted

    def finish(self, req, reason: str) -> None:
        """A request left its slot (reason: stop, length, abandoned)."""
        now = time.perf_counter()
        self.finished[reason] += 1
        self.prompt_tokens += len(req.ids)
        self.completion_tokens += req.emitted
        self.latency.observe(now - req.arrived)
        if req.first_token is not None:
            self.ttft.observe(req.first_token - req.arrived)
            if req.emitted > 1:
                self.per_token.observe((now - req.first_token) / (req.emitted - 1))

    def text(self) -> str:
        """The Prometheus exposition text."""
        p = PREFIX
        lines = [f"# TYPE {p}_requests_total counter"]
        lines += [f'{p}_requests_total{{finish="{k}"}} {v}' for k, v in sorted(self.finished.items())]
        lines += [f"# TYPE {p}_requests_rejected_total counter", f"{p}_requests_rejected_total {self.rejected}",
                  f"# TYPE {p}_requests_invalid_total counter", f"{p}_requests_invalid_total {self.invalid}",
                  f"# TYPE {p}_prompt_tokens_total counter", f"{p}_prompt_tokens_total {self.prompt_tokens}",
                  f"# TYPE {p}_completion_tokens_total counter",
                  f"{p}_completion_tokens_total {self.completion_tokens}",
                  f"# TYPE {p}_queue_length gauge", f"{p}_queue_length {self.queued}",
                  f"# TYPE {p}_slots gauge", f"{p}_slots {self.slots}",
                  f"# TYPE {p}_slots_busy gauge", f"{p}_slots_busy {self.busy}",
                  f"# TYPE {p}_speculative_rounds_total counter", f"{p}_speculative_rounds_total {self.rounds}",
                  f"# TYPE {p}_speculative_tokens_total counter", f"{p}_speculative_tokens_total {self.round_tokens}",
                  f"# TYPE {p}_mean_accepted_length gauge",
                  f"{p}_mean_accepted_length {self.round_tokens / max(self.rounds, 1):.4f}",
                  f"# TYPE {p}_chunks_total counter"]
        lines += [f'{p}_chunks_total{{drafts="{w}",budget="{b}"}} {n}' for (w, b), n in sorted(self.chunks.items())]
        lines += [f"# TYPE {p}_compile_seconds_total counter", f"{p}_compile_seconds_total {self.compile_seconds:.3f}"]
        for name, hist in (("time_to_first_token_seconds", self.ttft), ("request_seconds", self.latency),
                           ("time_per_output_token_seconds", self.per_token)):
            lines += [f"# TYPE {p}_{name} histogram"] + hist.lines(f"{p}_{name}")
        return "\n".join(lines) + "\n"
