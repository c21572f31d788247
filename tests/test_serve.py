"""`specformer serve` as clients meet it: the real server process on a free port, driven by the `openai` client and
by raw HTTP (httpx). Greedy answers are checked against plain greedy decoding (`generate` without a drafter) of the
same prompts, alone and 16 at once; bad input gets a 400 with the OpenAI error JSON and the server goes on; a full
queue gets a 503; a client that leaves frees its slot; SIGTERM finishes the running requests and exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.serving import protocol
from specformer_jax.serving.metrics import Histogram
from specformer_jax.serving.text import TextStream

NAME = "SmolLM2-135M-Instruct"
TOKENS = 16
PROMPTS = read_prompts_file(PROMPT_SETS["chat"])[:16]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `specformer serve` process; its stderr in a file (read on failure)."""

    def __init__(self, tmp_path, *extra: str):
        self.port, self.log = free_port(), tmp_path / f"serve-{time.monotonic_ns()}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "specformer_jax.cli", "serve", "--port",
                                          str(self.port), *extra], stdout=log, stderr=log)

    def ready(self) -> "Server":
        """The server, once GET /health answers 200."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(1)
        self.kill()
        raise AssertionError(f"the server did not come up: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """Stop the process at once, whatever it is doing (a failed test leaves no server behind)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def metric(self, name: str) -> float:
        lines = httpx.get(self.url + "/metrics").text.splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith(name + " ") or
                   line.startswith(name + "{"))

    def stop(self) -> int:
        """SIGTERM, and the exit status; killed if it has not exited within two minutes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        finally:
            self.kill()


def wait_for(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The server process, starting (the plain reference is computed meanwhile)."""
    s = Server(tmp_path_factory.mktemp("serve"), "--batch-size", "8", "--context", "512", "--max-queue", "64",
               "--warmup", "first")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def model(started):
    return load_target("default")


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy answers of PROMPTS: the reference every greedy answer of the server must equal."""
    return generate(model, PROMPTS, max_new_tokens=TOKENS, batch_size=8, drafter=None)


@pytest.fixture(scope="module")
def server(started, plain):
    return started.ready()


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=TOKENS, temperature=0, **kw)


def test_chat_and_completion_equal_plain_greedy_decoding(server, plain, model):
    client = server.client()
    answer = chat(client, PROMPTS[0])
    assert answer.choices[0].message.content == plain.texts[0]
    assert answer.usage.completion_tokens == len(plain.token_ids[0]) and answer.usage.prompt_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, PROMPTS[0], stream=True) if c.choices)
    assert streamed == plain.texts[0]
    ids = model.tokenizer.encode("The capital of France is")
    whole = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=TOKENS, temperature=0)
    reference = generate(model, [ids], max_new_tokens=TOKENS, batch_size=1, drafter=None)
    assert whole.choices[0].text == reference.texts[0]
    parts = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=TOKENS,
                                      temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts if c.choices) == reference.texts[0]
    assert [m.id for m in client.models.list().data] == [NAME]


def test_sixteen_concurrent_streams_each_equal_plain_decoding(server, plain):
    client = server.client()

    def one(prompt):
        return "".join(c.choices[0].delta.content or "" for c in chat(client, prompt, stream=True) if c.choices)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, PROMPTS))
    assert texts == plain.texts
    assert server.metric("specformer_slots_busy") == 0


def test_stop_strings_end_the_answer_before_them(server, plain):
    text = plain.texts[1]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    answer = chat(server.client(), PROMPTS[1], stop=[stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == text[: text.index(stop)]


@pytest.mark.slow  # a second sampling setting: another pool to compile
def test_a_seed_repeats_a_sampled_answer(server):
    client = server.client()
    a, b, c = (client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=TOKENS, temperature=0.9,
                                         seed=seed) for seed in (7, 7, 8))
    assert a.choices[0].text == b.choices[0].text != c.choices[0].text


BAD = [b"{not json", {"messages": "hello"}, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
       {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000},
       {"messages": [{"role": "user", "content": "word " * 600}]},
       {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"},
       {"messages": [{"role": "user", "content": "hi"}], "n": 2},
       {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
       {"messages": [{"role": "robot", "content": "hi"}]}, [1, 2, 3]]


@pytest.mark.parametrize("body", BAD, ids=range(len(BAD)))
def test_bad_input_gets_400_and_one_message(server, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and "\n" not in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_client_sees_400_as_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="n=3"):
        server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=3)


def test_a_client_that_leaves_frees_its_slot(server):
    before = server.metric('specformer_requests_total{finish="abandoned"}')
    body = {"model": NAME, "prompt": "Count from one to a thousand:", "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break  # leaving the block closes the connection mid-answer
    wait_for(lambda: server.metric('specformer_requests_total{finish="abandoned"}') > before)
    assert server.metric("specformer_slots_busy") == 0
    assert chat(server.client(), PROMPTS[2]).choices[0].finish_reason in ("stop", "length")


def test_full_queue_gets_503_and_sigterm_drains(tmp_path):
    s = Server(tmp_path, "--batch-size", "1", "--max-queue", "1", "--context", "512", "--drafter", "none",
               "--warmup", "first").ready()
    body = {"model": NAME, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 120, "temperature": 0}  # no EOS soon
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=300)
            wait_for(lambda: s.metric("specformer_slots_busy") == 1 or running.done())
            waiting = pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=300)
            wait_for(lambda: s.metric("specformer_queue_length") == 1 or waiting.done())
            assert not running.done() and not waiting.done(), "the answers ended before the queue filled"
            refused = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "overloaded_error"
            os.kill(s.proc.pid, signal.SIGTERM)
            assert running.result().status_code == 200 and waiting.result().status_code == 200
            assert running.result().json()["usage"]["completion_tokens"] == 120
            assert s.proc.wait(120) == 0
    finally:
        s.kill()
    with pytest.raises(httpx.TransportError):
        httpx.get(s.url + "/health", timeout=5)


def test_text_stream_holds_back_what_may_begin_a_stop_string():
    class Chars:  # a tokenizer whose tokens are characters
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    stream = TextStream(Chars(), ("END",))
    assert stream.add([ord(c) for c in "abcE"]) == "ab"  # the last two could begin "END"
    assert stream.add([ord("N")]) == "c"
    assert stream.add([ord(c) for c in "Dxyz"]) == "" and stream.stopped and stream.rest() == ""
    free = TextStream(Chars())
    assert free.add([ord("a")]) == "a" and free.rest() == ""


def test_protocol_refuses_what_it_cannot_honour():
    job = protocol.parse_job({"prompt": [5, 6], "max_tokens": 3, "top_k": 4, "stop": "x"}, chat=False, served=NAME)
    assert (job.prompt, job.max_tokens, job.sampling.top_k, job.stop, job.sampling.temperature) == ([5, 6], 3, 4,
                                                                                                    ("x",), 1.0)
    for body, field in (({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "logprobs": 2}, "logprobs"),
                        ({"prompt": "a", "stop": ["a"] * 5}, "stop"), ({"prompt": ""}, "prompt"),
                        ({"prompt": "a", "top_p": 0}, "top_p"), ({"prompt": "a", "seed": -1}, "seed")):
        with pytest.raises(protocol.BadRequest) as e:
            protocol.parse_job(body, chat=False, served=NAME)
        assert e.value.param == field


def test_histogram_is_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    assert h.lines("x")[:3] == ['x_bucket{le="0.1"} 1', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4']
