"""The server's engine without HTTP: requests arriving while others decode, more of them than slots, rows moved to keep
the live ones first, chunks over only those rows, plain chunks that skip the drafter when many are live, the default
verify budget when three or four are, an abandoned request, and a second sampling setting beside greedy ones. Every
greedy answer equals plain decoding of that prompt alone (test_engine.plain_alone: the target's forward a token at a
time, no engine)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from test_engine import BUDGETS, PROMPTS, model, plain_alone  # noqa: F401 -- model: the fixture

from specformer_jax import defaults
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.engine import runner
from specformer_jax.decoding.engine.chunk import run_first_rows, run_plain_chunk
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.serving.engine import QueueFull, Request, ServeConfig, ServingEngine


class Answer:
    def __init__(self):
        self.ids, self.reason, self.done = [], None, threading.Event()

    def request(self, prompt, budget, sampling=SamplingConfig(), seed=0) -> Request:
        return Request(list(prompt), budget, sampling, seed, self.ids.extend, self.finish)

    def finish(self, reason):
        self.reason = self.reason or reason
        self.done.set()


def served(engine: ServingEngine, prompts) -> list[Answer]:
    """The prompts (with BUDGETS) submitted to the started engine at once; their answers when all are done, the engine
    stopped."""
    answers = [Answer() for _ in prompts]
    try:
        for a, p, b in zip(answers, prompts, BUDGETS):
            engine.submit(a.request(p, b))
        assert all(a.done.wait(300) for a in answers)
    finally:
        engine.stop()
    return answers


# CI time: test_serve.py's sixteen concurrent streams on the real server equal plain decoding in `make test`
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["random", None])
def test_requests_arriving_mid_flight_decode_as_alone(model, drafter, monkeypatch):  # noqa: F811
    # six live rows decode plainly, as past the table's budgets: the chunks that skip the drafter are run too
    monkeypatch.setattr(defaults, "CPU_VERIFY_BUDGETS", {"specformer": {range(3, 5): (2, 8)}})
    source = resolve_drafter(drafter, model) if drafter else None
    engine = ServingEngine(model, source, ServeConfig(slots=6, context=96, draft_len=None, chunk_rounds=3,
                                                      max_queue=16)).start()
    answers = [Answer() for _ in PROMPTS]
    sampled = Answer()
    try:
        for i, (a, p, b) in enumerate(zip(answers, PROMPTS, BUDGETS)):
            engine.submit(a.request(p, b))
            if i == 5:
                engine.submit(sampled.request(PROMPTS[0], 12, SamplingConfig(0.8), seed=3))
            if i % 3 == 2:
                time.sleep(0.3)  # later requests join rows that are mid-answer
        for a in answers + [sampled]:
            assert a.done.wait(300)
    finally:
        engine.stop()
    for a, p, b in zip(answers, PROMPTS, BUDGETS):
        assert a.ids == plain_alone(model, p, b)
        assert a.reason == ("stop" if a.ids[-1] in model.eos_ids else "length")
    assert 1 <= len(sampled.ids) <= 12 and sampled.reason in ("stop", "length")
    assert engine.metrics.busy == 0 and engine.metrics.finished["abandoned"] == 0
    assert runner.COMPILED.count(run_first_rows) >= 1  # fewer live rows than slots ran over fewer rows
    if drafter:
        assert engine.metrics.chunks[0, 0] >= 1 and runner.COMPILED.count(run_plain_chunk) + runner.COMPILED.count(
            run_first_rows) >= 2  # six live rows: plain chunks that skip the drafter


def test_three_or_four_live_requests_verify_the_default_budget_and_decode_as_alone(model):  # noqa: F811
    """With three or four rows live, a chunk runs the round `generate` runs for that batch on a CPU with its kernels
    (defaults.CPU_VERIFY_BUDGETS: 2 drafts a row, 8 positions a round); with one, whole draft lengths."""
    if not model.use_decoding_layout(4).cfg.pack_weights:
        pytest.skip("the default budget is measured for the CPU kernels, which are not in use here")
    engine = ServingEngine(model, resolve_drafter("random", model), ServeConfig(slots=4, context=96, draft_len=None,
                                                                                chunk_rounds=2, max_queue=16)).start()
    answers = served(engine, PROMPTS[:6])
    assert all(a.ids == plain_alone(model, p, b) for a, p, b in zip(answers, PROMPTS, BUDGETS))
    rounds = set(engine.metrics.chunks)
    assert (2, 8) in rounds and any(w and not b for w, b in rounds), rounds
    assert 'chunks_total{drafts="2",budget="8"}' in engine.metrics.text()


def test_abandoned_request_frees_its_slot_and_a_full_queue_refuses(model):  # noqa: F811
    endless = dataclasses.replace(model, eos_ids=())  # the first request runs until it is abandoned
    engine = ServingEngine(endless, None, ServeConfig(slots=1, context=96, draft_len=None, chunk_rounds=1,
                                                    max_queue=1)).start()
    first, second = Answer(), Answer()
    try:
        running = first.request(PROMPTS[0], 90)
        engine.submit(running)
        while not first.ids:
            time.sleep(0.01)
        engine.submit(second.request(PROMPTS[2], BUDGETS[2]))
        with pytest.raises(QueueFull):
            engine.submit(Answer().request(PROMPTS[1], 5))
        engine.abandon(running)
        assert first.done.wait(60) and first.reason == "abandoned"
        assert second.done.wait(120) and second.ids == plain_alone(endless, PROMPTS[2], BUDGETS[2])
    finally:
        engine.stop()
    assert engine.metrics.finished["abandoned"] == 1 and engine.metrics.busy == 0



@pytest.mark.slow  # CI time: test_serve.py's server warms up first
@pytest.mark.parametrize("drafter", ["random", "ngram"])  # ngram: its chunks narrow to what its rows' matches need
def test_compiled_ahead_nothing_compiles_while_serving(model, drafter):  # noqa: F811
    engine = ServingEngine(model, resolve_drafter(drafter, model),
                           ServeConfig(slots=4, context=96, draft_len=None, chunk_rounds=2, max_queue=16))
    engine.compile_ahead()
    ahead = engine.metrics.compile_seconds
    answers = served(engine.start(), PROMPTS)
    assert ahead > 0 and engine.metrics.compile_seconds == ahead
    assert all(a.ids == plain_alone(model, p, b) for a, p, b in zip(answers, PROMPTS, BUDGETS))
