"""A load generator for any OpenAI-compatible HTTP server: ours (`specformer serve`) or llama.cpp's `llama-server`.

What it does: it sends `--num-requests` streamed requests (chat completions by default), built from the prompts of
a JSONL file (cycled), in one of two ways:

- `--concurrency C`, a closed loop: C requests are in flight at all times; a new one starts when one ends;
- `--rate R`, an open loop: requests arrive at random (Poisson) at R a second, whether or not the server keeps up.

It reads each answer's server-sent events as they arrive and measures what a client of the server sees: the time to
the first token (TTFT), the time between tokens (ITL) and the tokens per second of the whole run.

Why: a server under load (many clients at once, clients that hang up early, bad requests mixed in) is not the
decoding loop that `specformer bench` times. This measures through HTTP, in the same way for any server, so that
ours can be compared with llama-server on equal terms and its error handling checked at the same time.

The rules, in short:

- Every valid request asks for `"stream": true` with `"stream_options": {"include_usage": true}`, `--max-tokens`
  and `--temperature`. A request is `completed` when it got HTTP 200 and a finish_reason. Its token count is the
  `usage.completion_tokens` of the last chunk that carries usage, else the number of events with text.
- `--malformed-fraction F`: every round(1/F)-th request is sent broken instead (in turn: a body that is not JSON,
  max_tokens=-1, n=2, messages / prompt of the wrong type, an unknown model name). Each must be refused with HTTP 400
  and a JSON body {"error": {"message": ..., "type": ...}}; anything else counts as `failed`.
- `--abandon-fraction F`: every round(1/F)-th valid request is closed by the client after its first 2 events with
  text (`abandoned`); one that ends before that counts as completed.
- TTFT: from sending a request to its first event with text (completed and abandoned requests). ITL of a request:
  (last text event - first text event) / (tokens - 1), for completed requests of 2 tokens or more. `event_gap_s`:
  the gaps between consecutive text events of every request. Throughput: completed requests' tokens over
  `duration_s`, from the first request sent to the last one finished.

Run it against a server that is already up, for example:

    .venv/bin/python benchmarks/bench_serve.py --url http://127.0.0.1:8000 --num-requests 64 --concurrency 8 \\
        --out /tmp/serve_c8.json

The JSON (`--out`, written atomically) holds the command, settings, host and `results`; without `--out` it is
printed on stdout. Exit status: 0 when no request failed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "specformer_jax" / "assets" / "eval-prompts.jsonl"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MALFORMED_KINDS = ("not_json", "negative_max_tokens", "n_2", "wrong_type", "unknown_model")
ABANDON_AFTER = 2  # events with text an abandoning client reads before it closes the stream
PROGRESS_EVERY_S = 5.0
MAX_EXAMPLES = 10


class LoadError(RuntimeError):
    """The run could not start (the server cannot be reached, it lists no model, the prompts file is unusable)."""


@dataclass
class Outcome:
    """What one request saw. Times are seconds since the start of the run."""

    index: int
    kind: str  # "valid", "abandon" (a valid request the client leaves early) or one of MALFORMED_KINDS
    start: float = 0.0
    end: float = 0.0
    done: bool = False
    status: int | None = None
    events: list[float] = field(default_factory=list)  # the time of each event with text
    parts: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    finish_reason: str | None = None
    abandoned: bool = False
    error: str | None = None  # a short kind of error, None when none
    detail: str | None = None

    @property
    def malformed(self) -> bool:
        return self.kind in MALFORMED_KINDS

    @property
    def completed(self) -> bool:
        return (not self.malformed and not self.abandoned and self.error is None and self.status == 200
                and self.finish_reason is not None)

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.events)


# ---- the requests to send -------------------------------------------------------------------------------------


def load_prompts(path: str | Path) -> list[str]:
    """The "prompt" of each line of a JSONL file (blank lines skipped)."""
    prompts = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LoadError(f"cannot read the prompts file {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LoadError(f"{path}:{number} is not a JSON object with a \"prompt\"") from None
        if not isinstance(prompt, str):
            raise LoadError(f"{path}:{number}: the \"prompt\" is not a string")
        prompts.append(prompt)
    if not prompts:
        raise LoadError(f"{path} holds no prompts")
    return prompts


def every(fraction: float) -> int:
    """Every how many requests one is picked for a share `fraction`; 0 for none."""
    return 0 if fraction <= 0 else max(1, round(1 / fraction))


def request_plan(num_requests: int, malformed_fraction: float, abandon_fraction: float) -> list[str]:
    """The kind of each request, in order. Malformed ones are every round(1/F)-th request, their kinds in turn; of
    the valid ones, every round(1/F)-th is abandoned. Deterministic: the same settings send the same requests."""
    m_step, a_step = every(malformed_fraction), every(abandon_fraction)
    plan: list[str] = []
    malformed = valid = 0
    for i in range(num_requests):
        if m_step and (i + 1) % m_step == 0:
            plan.append(MALFORMED_KINDS[malformed % len(MALFORMED_KINDS)])
            malformed += 1
        else:
            valid += 1
            plan.append("abandon" if a_step and valid % a_step == 0 else "valid")
    return plan


def valid_body(endpoint: str, model: str, prompt: str, max_tokens: int, temperature: float) -> dict:
    """A streamed request that asks for the usage in its last chunk."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def malformed_content(kind: str, body: dict, endpoint: str) -> bytes:
    """The bytes of a broken request of this kind, made from a valid `body`; a server must answer it with 400."""
    if kind == "not_json":
        return json.dumps(body).encode()[:-1] + b", this is not JSON"
    body = dict(body)
    if kind == "negative_max_tokens":
        body["max_tokens"] = -1
    elif kind == "n_2":
        body["n"] = 2
    elif kind == "wrong_type" and endpoint == "chat":
        body["messages"] = body["messages"][0]["content"]  # a string where a list belongs
    elif kind == "wrong_type":
        body["prompt"] = {"text": body["prompt"]}  # an object where a string (or list) belongs
    elif kind == "unknown_model":
        body["model"] = "no-such-model-" + str(body["model"])
    return json.dumps(body).encode()


# ---- sending one request ---------------------------------------------------------------------------------------


def since(t0: float) -> float:
    return time.perf_counter() - t0


def event_text(choice: dict) -> str | None:
    """The new text of one choice of a streamed chunk: a chat delta's content, or a completion's text."""
    if isinstance(choice.get("delta"), dict):
        return choice["delta"].get("content")
    return choice.get("text")


def take_chunk(chunk: dict, out: Outcome, t0: float) -> None:
    """Note one parsed event: its text (with the time), its finish_reason, its usage, or the error it carries."""
    if "error" in chunk:
        out.error, out.detail = "stream_error", str(chunk["error"])[:200]
        return
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        out.usage_tokens = usage["completion_tokens"]
    for choice in chunk.get("choices") or []:
        text = event_text(choice)
        if text:
            out.events.append(since(t0))
            out.parts.append(text)
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


async def read_events(resp: httpx.Response, out: Outcome, t0: float) -> None:
    """Read the server-sent events ("data: {...}" lines) up to "data: [DONE]". An abandoning request returns after
    its first ABANDON_AFTER events with text; leaving the response then closes the connection."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            out.error, out.detail = "bad_event", data[:200]
            return
        take_chunk(chunk if isinstance(chunk, dict) else {}, out, t0)
        if out.error:
            return
        if out.kind == "abandon" and len(out.events) >= ABANDON_AFTER and out.finish_reason is None:
            out.abandoned = True
            return


async def send_valid(client: httpx.AsyncClient, path: str, body: dict, out: Outcome, t0: float,
                     timeout: float) -> None:
    """Send one valid streamed request and note what came back."""
    async with asyncio.timeout(timeout):
        async with client.stream("POST", path, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = f"http_{resp.status_code}"
                out.detail = (await resp.aread())[:200].decode(errors="replace")
                return
            await read_events(resp, out, t0)


def is_error_json(raw: bytes) -> bool:
    """Whether a body is the OpenAI error JSON: {"error": {"message": ..., "type": ..., ...}}."""
    try:
        error = json.loads(raw).get("error")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and "message" in error and "type" in error


async def send_malformed(client: httpx.AsyncClient, path: str, content: bytes, out: Outcome, timeout: float) -> None:
    """Send one broken request. Anything but a 400 with the error JSON is noted as an error; an answer that was
    accepted is not read (it could be endless: max_tokens=-1 means "no limit" to some servers)."""
    async with asyncio.timeout(timeout):
        async with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as resp:
            out.status = resp.status_code
            if resp.status_code != 400:
                out.error = f"not_refused_http_{resp.status_code}"
                return
            raw = await resp.aread()
    if not is_error_json(raw):
        out.error, out.detail = "400_without_error_json", raw[:200].decode(errors="replace")


async def send(client: httpx.AsyncClient, path: str, body: dict, endpoint: str, out: Outcome, t0: float,
               timeout: float) -> None:
    """Send request `out.index` (valid or malformed) and fill in `out`, whatever happens."""
    out.start = since(t0)
    try:
        if out.malformed:
            await send_malformed(client, path, malformed_content(out.kind, body, endpoint), out, timeout)
        else:
            await send_valid(client, path, body, out, t0, timeout)
    except TimeoutError:
        out.error, out.detail = "timeout", f"no answer within {timeout:g} s"
    except (httpx.HTTPError, OSError) as e:
        out.error, out.detail = type(e).__name__, (str(e) or repr(e))[:200]
    finally:
        out.end, out.done = since(t0), True


# ---- running many ----------------------------------------------------------------------------------------------


async def closed_loop(jobs: list, concurrency: int) -> None:
    """Run the jobs with `concurrency` of them in flight: each worker starts the next job when its last one ends."""
    pending = iter(jobs)

    async def worker() -> None:
        for job in pending:
            await job()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(jobs: list, rate: float, seed: int, t0: float) -> None:
    """Start the jobs at Poisson arrival times (`rate` a second, the first at once), then wait for all of them."""
    rng, at, tasks = random.Random(seed), 0.0, []
    for job in jobs:
        delay = at - since(t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(job()))
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)


async def show_progress(outcomes: list[Outcome], t0: float, label: str) -> None:
    """Print "done/total" on stderr every few seconds until cancelled."""
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        done = sum(o.done for o in outcomes)
        print(f"bench_serve{' ' + label if label else ''}: {done}/{len(outcomes)} done, {since(t0):.0f} s",
              file=sys.stderr, flush=True)


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise LoadError(f"cannot read the model's name from {client.base_url}/v1/models: {e}") from None


# ---- the summary -----------------------------------------------------------------------------------------------


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, linearly interpolated (numpy's default)."""
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: list[float], mean: bool = True) -> dict:
    """p50, p90, p99 (and the mean) of the values; None for each when there are none."""
    ordered = sorted(values)
    out = {f"p{q}": percentile(ordered, q / 100) if ordered else None for q in (50, 90, 99)}
    if mean:
        out["mean"] = sum(ordered) / len(ordered) if ordered else None
    return out


def failure_reason(o: Outcome) -> str | None:
    """Why a request counts as failed, or None when it does not."""
    if o.malformed:
        return None if o.status == 400 and o.error is None else (o.error or f"http_{o.status}")
    if o.completed or (o.abandoned and o.error is None):
        return None
    if o.error:
        return o.error + (f": {o.detail}" if o.detail else "")
    return f"http_{o.status} without a finish_reason"


def summarize(outcomes: list[Outcome]) -> dict:
    """The `results` of a run (see the module's docstring for what each figure means)."""
    completed = [o for o in outcomes if o.completed]
    answered = [o for o in outcomes if (o.completed or o.abandoned) and o.events]
    failures = [(o, r) for o in outcomes if (r := failure_reason(o)) is not None]
    duration = max(o.end for o in outcomes) - min(o.start for o in outcomes)
    tokens = sum(o.tokens for o in completed)
    itl = [(o.events[-1] - o.events[0]) / (o.tokens - 1) for o in completed if o.tokens >= 2 and len(o.events) >= 2]
    gaps = [b - a for o in answered for a, b in zip(o.events, o.events[1:])]
    return {"completed": len(completed), "abandoned": sum(o.abandoned and o.error is None for o in outcomes),
            "malformed_sent": sum(o.malformed for o in outcomes),
            "malformed_rejected_400": sum(o.malformed and failure_reason(o) is None for o in outcomes),
            "failed": len(failures),
            "failed_examples": [{"index": o.index, "kind": o.kind, "reason": r} for o, r in failures[:MAX_EXAMPLES]],
            "duration_s": duration, "output_tokens": tokens,
            "output_tokens_per_s": tokens / duration if duration > 0 else None,
            "requests_per_s": len(completed) / duration if duration > 0 else None,
            "ttft_s": spread([o.events[0] - o.start for o in answered]), "itl_s": spread(itl),
            "event_gap_s": spread(gaps, mean=False)}


def host_facts() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write_json(path: str | Path, data: dict) -> None:
    """Write JSON atomically: into a temporary file beside `path`, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the entry points ------------------------------------------------------------------------------------------


async def run_load_async(url: str, *, model: str | None = None, prompts: list[str] | None = None,
                         prompts_path: str | Path | None = None, num_requests: int = 64,
                         concurrency: int | None = None, rate: float | None = None, max_tokens: int = 64,
                         temperature: float = 0.0, endpoint: str = "chat", malformed_fraction: float = 0.0,
                         abandon_fraction: float = 0.0, seed: int = 0, timeout: float = 600.0,
                         keep_texts: bool = False, label: str = "", command: str | None = None,
                         progress: bool = True) -> dict:
    """run_load, for a caller that already runs an event loop."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    if prompts is None:
        prompts_path = prompts_path or DEFAULT_PROMPTS
        prompts = load_prompts(prompts_path)
    url = url.rstrip("/")
    settings = {"endpoint": endpoint, "num_requests": num_requests, "concurrency": concurrency, "rate": rate,
                "max_tokens": max_tokens, "temperature": temperature, "malformed_fraction": malformed_fraction,
                "abandon_fraction": abandon_fraction, "seed": seed, "timeout_s": timeout, "keep_texts": keep_texts,
                "prompts": str(prompts_path) if prompts_path else None, "num_prompts": len(prompts)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency or 64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout), limits=limits,
                                 trust_env=False) as client:
        model = model or await first_model(client)
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        outcomes = await drive(client, model, prompts, settings, progress, label)
    out = {"command": command, "label": label, "url": url, "model": model, "settings": settings,
           "started_utc": started, "host": host_facts(), "results": summarize(outcomes)}
    if keep_texts:
        out["texts"] = ["".join(o.parts) if o.completed else None for o in outcomes]
    return out


async def drive(client: httpx.AsyncClient, model: str, prompts: list[str], s: dict, progress: bool,
                label: str) -> list[Outcome]:
    """Send every request of the plan, in a closed or an open loop, and return what each saw, in request order."""
    plan = request_plan(s["num_requests"], s["malformed_fraction"], s["abandon_fraction"])
    outcomes = [Outcome(i, kind) for i, kind in enumerate(plan)]
    path, t0 = PATHS[s["endpoint"]], time.perf_counter()

    def job(o: Outcome):
        body = valid_body(s["endpoint"], model, prompts[o.index % len(prompts)], s["max_tokens"], s["temperature"])
        return lambda: send(client, path, body, s["endpoint"], o, t0, s["timeout_s"])

    jobs = [job(o) for o in outcomes]
    ticker = asyncio.create_task(show_progress(outcomes, t0, label)) if progress else None
    try:
        if s["concurrency"] is not None:
            await closed_loop(jobs, s["concurrency"])
        else:
            await open_loop(jobs, s["rate"], s["seed"], t0)
    finally:
        if ticker:
            ticker.cancel()
    return outcomes


def run_load(url: str, **kwargs) -> dict:
    """Run one load test against the server at `url` and return its result dict (the JSON that --out writes).

    Keyword arguments: model (default: the first of GET /v1/models), prompts (a list of str) or prompts_path (a
    JSONL file; default: the benchmark prompts), num_requests, concurrency or rate (exactly one), max_tokens,
    temperature, endpoint ("chat" or "completions"), malformed_fraction, abandon_fraction, seed, timeout (seconds
    a request), keep_texts, label, command, progress (a line on stderr every few seconds). Raises LoadError when
    the run cannot start."""
    return asyncio.run(run_load_async(url, **kwargs))


def bounded(kind, low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: `kind` of the input, checked to lie in [low, high] ((low, high] when low_open)."""
    def parse(text: str):
        value = kind(text)
        if value < low or (low_open and value == low) or (high is not None and value > high):
            bound = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r} is not a number {bound}")
        return value
    parse.__name__ = kind.__name__
    return parse


def parse_with_prompts(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """p's arguments, with the prompts of --prompts read into `prompt_list` (a bad file: one line, exit 2)."""
    args = p.parse_args(argv)
    try:
        args.prompt_list = load_prompts(args.prompts)
    except LoadError as e:
        p.error(str(e))
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Load an OpenAI-compatible server with streamed requests and measure "
                                            "TTFT, inter-token latency and throughput.")
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="a JSONL file of {\"prompt\": ...} lines")
    p.add_argument("--num-requests", type=bounded(int, 1), default=64, help="requests in all (prompts cycled)")
    loop = p.add_mutually_exclusive_group(required=True)
    loop.add_argument("--concurrency", type=bounded(int, 1), help="requests in flight at all times (closed loop)")
    loop.add_argument("--rate", type=bounded(float, 0, low_open=True),
                      help="Poisson arrivals, requests a second (open loop)")
    p.add_argument("--max-tokens", type=bounded(int, 1), default=64)
    p.add_argument("--temperature", type=bounded(float, 0), default=0.0)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--malformed-fraction", type=bounded(float, 0, 1), default=0.0,
                   help="share of requests sent broken; each must get HTTP 400 with an error JSON")
    p.add_argument("--abandon-fraction", type=bounded(float, 0, 1), default=0.0,
                   help="share of valid requests the client closes after their first 2 events with text")
    p.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrivals of --rate")
    p.add_argument("--timeout", type=bounded(float, 0, low_open=True), default=600.0, help="seconds a request")
    p.add_argument("--keep-texts", action="store_true", help="store each completed answer's text under `texts`")
    p.add_argument("--label", default="", help="free text stored in the output")
    p.add_argument("--out", default=None, help="the JSON file to write (default: print the JSON on stdout)")
    return parse_with_prompts(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    try:
        out = run_load(args.url, model=args.model, prompts=args.prompt_list, prompts_path=args.prompts,
                       num_requests=args.num_requests, concurrency=args.concurrency, rate=args.rate,
                       max_tokens=args.max_tokens, temperature=args.temperature, endpoint=args.endpoint,
                       malformed_fraction=args.malformed_fraction, abandon_fraction=args.abandon_fraction,
                       seed=args.seed, timeout=args.timeout, keep_texts=args.keep_texts, label=args.label,
                       command=command)
    except LoadError as e:
        print(f"bench_serve: {e}", file=sys.stderr)
        return 1
    r = out["results"]
    print(f"bench_serve: {r['completed']} completed, {r['abandoned']} abandoned, {r['malformed_rejected_400']}/"
          f"{r['malformed_sent']} malformed refused, {r['failed']} failed; {fmt(r['output_tokens_per_s'])} tokens/s, "
          f"TTFT p50 {fmt(r['ttft_s']['p50'], 1000)} ms, ITL p50 {fmt(r['itl_s']['p50'], 1000)} ms", file=sys.stderr)
    if args.out:
        write_json(args.out, out)
    else:
        print(json.dumps(out, indent=1))
    return 0 if r["failed"] == 0 else 1


def fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


if __name__ == "__main__":
    sys.exit(main())
