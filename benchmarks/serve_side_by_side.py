"""Our HTTP server with speculative decoding against the same server without it (and optionally llama-server), under
the same load, one server at a time.

What it does, for each side in turn:

- `spec`:  `specformer serve --port P --batch-size S --context N --drafter default` (speculative decoding);
- `plain`: the same with `--drafter none` (plain decoding);
- `llama` (only with `--llama-server PATH` and `--llama-gguf F32.gguf`): `llama-server -m F32.gguf --port P -np S
  -c S*N -t <cpus> --cont-batching`, llama.cpp's server with S slots of N positions each, on the float32 weights;

it starts the server, waits until GET /health answers 200 (at most 600 s), warms it up (2*S requests at concurrency S,
8 tokens each, not measured, and again 2*C requests at each concurrency C before its run), then runs
benchmarks/bench_serve.py's `run_load` at each concurrency C of `--concurrency` (llama: `--llama-concurrency`) with
max(`--requests-per-level`, 2*C) streamed requests, and stops the server (SIGTERM; SIGKILL after 60 s).

Why: `specformer bench` times the decoding loop; a user of `specformer serve` sees HTTP, the scheduler and the
tokenizer as well. This measures what speculative decoding buys end to end at each load (`ratios`: spec/plain
tokens/s, plain/spec median inter-token latency, so above 1 means speculative decoding is faster, and spec/llama
tokens/s where llama-server ran), and with `--check-texts` whether it changes any greedy answer (`lossless`: the
concurrency-1 answers of spec and plain at temperature 0 compared text by text).

    .venv/bin/python benchmarks/serve_side_by_side.py --out benchmarks/results/serve_side_by_side_cpu.json \\
        --check-texts [--llama-server <build>/bin/llama-server --llama-gguf <f32>.gguf]

The JSON (`--out`) is rewritten atomically after every level ("complete": false until the end); a table goes to
stdout at the end. Server logs are kept in a temporary directory, printed at the start. Exit status: 0 when every
side ran and no request failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import DEFAULT_PROMPTS, REPO, LoadError, host_facts, parse_with_prompts, run_load, write_json  # noqa: E402

READY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60
POLL_S = 1.0
WARMUP_MAX_TOKENS = 8


class SideError(RuntimeError):
    """A server that could not be started or measured."""


# ---- the servers ------------------------------------------------------------------------------------------------


def our_command(args, drafter: str) -> list[str]:
    """`specformer serve` with this drafter ("default" or "none") and the shared settings."""
    cmd = [sys.executable, "-m", "specformer_jax.cli", "serve", "--port", str(args.port), "--batch-size",
           str(args.batch_size), "--context", str(args.context), "--drafter", drafter]
    if args.model:
        cmd += ["--model", args.model]
    return cmd + shlex.split(args.serve_args)


def llama_command(args) -> list[str]:
    """llama-server with as many slots as ours, each with our context, on every CPU."""
    return [args.llama_server, "-m", args.llama_gguf, "--host", "127.0.0.1", "--port", str(args.port), "-np",
            str(args.batch_size), "-c", str(args.batch_size * args.context), "-t", str(os.cpu_count()),
            "--cont-batching", *shlex.split(args.llama_args)]


def check_port_free(port: int) -> None:
    """Refuse a port something already listens on: its /health would pass for our server's."""
    try:
        with socket.create_server(("127.0.0.1", port)):
            pass
    except OSError as e:
        raise SideError(f"port {port} is in use ({e.strerror or e}): pass another --port") from None


def last_lines(path: Path, n: int = 20) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-n:]) or "(no output)"


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> float:
    """Poll GET /health until it answers 200; the seconds that took. Fails when the server exits or takes too long."""
    t0 = time.perf_counter()
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.perf_counter() - t0 < READY_TIMEOUT_S:
            if proc.poll() is not None:
                raise SideError(f"the server exited with status {proc.returncode} before it was ready; its last "
                                f"lines:\n{last_lines(log)}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
    raise SideError(f"the server was not ready after {READY_TIMEOUT_S} s; its last lines:\n{last_lines(log)}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the server has not exited after STOP_TIMEOUT_S."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"serve_side_by_side: the server did not stop within {STOP_TIMEOUT_S} s: killed", file=sys.stderr)
        proc.kill()
        proc.wait()


@contextmanager
def server(cmd: list[str], port: int, log: Path) -> Iterator[float]:
    """A running server (its output in `log`), stopped on the way out; yields its start-up seconds."""
    check_port_free(port)
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    except OSError as e:
        raise SideError(f"cannot start {cmd[0]}: {e.strerror or e}") from None
    try:
        yield wait_ready(proc, f"http://127.0.0.1:{port}", log)
    finally:
        stop(proc)


# ---- measuring one side -----------------------------------------------------------------------------------------


def load(args, prompts: list[str], num_requests: int, concurrency: int, label: str, **kw) -> dict:
    """One run_load against the server on --port with the shared settings (keywords override them)."""
    settings = dict(prompts=prompts, prompts_path=args.prompts, num_requests=num_requests, concurrency=concurrency,
                    max_tokens=args.max_tokens, temperature=args.temperature, endpoint=args.endpoint,
                    timeout=args.timeout, label=label)
    return run_load(f"http://127.0.0.1:{args.port}", **(settings | kw))


def measured(run: dict) -> dict:
    """A run_load result as stored here: without its texts and host (the host is recorded once, at the top)."""
    return {k: v for k, v in run.items() if k not in ("texts", "host")}


def compile_seconds(port: int) -> float | None:
    """Our server's specformer_compile_seconds_total (GET /metrics); None for a server without it."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [line.split()[-1] for line in text.splitlines() if line.startswith("specformer_compile_seconds_total ")]
    return float(values[0]) if values else None


def measure_side(name: str, cmd: list[str], levels: list[int], args, prompts: list[str], log: Path,
                 save) -> tuple[dict, list | None]:
    """Start one server, warm it up, run every level; its record and (with --check-texts) its concurrency-1 texts
    at temperature 0. `save` is called with the record after every level."""
    side: dict = {"status": "running", "command": shlex.join(cmd), "log": str(log), "levels": {}}
    texts = None
    print(f"serve_side_by_side: {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with server(cmd, args.port, log) as startup_s:
        side["startup_s"] = startup_s
        warm = load(args, prompts, 2 * args.batch_size, args.batch_size, f"{name} warm-up",
                    max_tokens=WARMUP_MAX_TOKENS, progress=False)
        side["warmup"] = {k: warm["results"][k] for k in ("completed", "failed", "duration_s")}
        for c in levels:
            keep = args.check_texts and c == 1 and args.temperature == 0
            load(args, prompts, 2 * c, c, f"{name} c={c} warm-up", max_tokens=WARMUP_MAX_TOKENS, progress=False)
            compiled = compile_seconds(args.port)
            run = load(args, prompts, max(args.requests_per_level, 2 * c), c, f"{name} c={c}", keep_texts=keep)
            texts = run.get("texts", texts)
            side["levels"][str(c)] = measured(run)
            if compiled is not None:  # compilation that fell inside the measured run (ours only)
                side["levels"][str(c)]["compile_s_during_run"] = compile_seconds(args.port) - compiled
            save(side)
        if args.check_texts and name != "llama" and texts is None:
            run = load(args, prompts, max(args.requests_per_level, 2), 1, f"{name} texts", temperature=0.0,
                       keep_texts=True)
            texts, side["texts_run"] = run["texts"], measured(run)
    side["status"] = "ok"
    save(side)
    return side, texts


# ---- the comparison ---------------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def figure(side: dict | None, c: int, key: str) -> float | None:
    """output_tokens_per_s or the p50 ITL of one side at concurrency c; None when it did not run there."""
    run = (side or {}).get("levels", {}).get(str(c))
    if run is None:
        return None
    r = run["results"]
    return r["output_tokens_per_s"] if key == "tokens_per_s" else r["itl_s"]["p50"]


def ratios(sides: dict, levels: list[int]) -> dict:
    """Per concurrency: spec/plain tokens/s, plain/spec p50 ITL (> 1: spec is faster) and spec/llama tokens/s."""
    spec, plain, llama = sides.get("spec"), sides.get("plain"), sides.get("llama")
    return {str(c): {"spec_over_plain_tokens_per_s": ratio(figure(spec, c, "tokens_per_s"),
                                                           figure(plain, c, "tokens_per_s")),
                     "itl_p50_plain_over_spec": ratio(figure(plain, c, "itl"), figure(spec, c, "itl")),
                     "spec_over_llama_tokens_per_s": ratio(figure(spec, c, "tokens_per_s"),
                                                           figure(llama, c, "tokens_per_s"))}
            for c in levels}


def lossless(spec_texts: list | None, plain_texts: list | None) -> dict:
    """Whether spec and plain gave the same greedy text for every request both completed."""
    if spec_texts is None or plain_texts is None:
        return {"checked": False, "reason": "a side did not run to the end"}
    pairs = [(i, s, p) for i, (s, p) in enumerate(zip(spec_texts, plain_texts)) if s is not None and p is not None]
    bad = [i for i, s, p in pairs if s != p]
    return {"checked": True, "temperature": 0.0, "compared": len(pairs), "mismatches": len(bad),
            "equal": not bad and bool(pairs), "mismatch_indices": bad[:10]}


def versions(args) -> dict:
    """Python, jax, specformer-jax, httpx, the git commit, and llama-server's own version line when it runs."""
    out = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "specformer-jax", "httpx"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    out["git_commit"] = run_quiet(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    out["git_dirty"] = bool(run_quiet(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]))
    if args.llama_server:
        text = run_quiet([args.llama_server, "--version"]) or ""
        out["llama_server"] = next((line for line in text.splitlines() if "version" in line), text[:200] or None)
    return out


def run_quiet(cmd: list[str]) -> str | None:
    """A command's output (stdout and stderr), or None when it cannot be run."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout + proc.stderr).strip()


# ---- the command line -------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 1,2,4")
    return values


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not > 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def port_number(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number in 1..65535")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="specformer serve with and without speculative decoding (and "
                                            "llama-server) under the same streamed load, one server at a time.")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--model", default=None, help="--model for specformer serve (default: its default model)")
    p.add_argument("--batch-size", type=positive(int), default=16, help="server slots (llama-server: -np)")
    p.add_argument("--context", type=positive(int), default=2048, help="positions a slot holds (llama: -c S*this)")
    p.add_argument("--port", type=port_number, default=8011, help="the port each server listens on in turn")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="levels for spec and plain")
    p.add_argument("--llama-concurrency", type=int_list, default=[1, 4, 16], help="levels for llama-server")
    p.add_argument("--requests-per-level", type=positive(int), default=16,
                   help="requests at each level: max(this, 2*concurrency)")
    p.add_argument("--max-tokens", type=positive(int), default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="a JSONL file of {\"prompt\": ...} lines")
    p.add_argument("--timeout", type=positive(float), default=600.0, help="seconds a request")
    p.add_argument("--check-texts", action="store_true",
                   help="compare spec's and plain's concurrency-1 answers at temperature 0 (`lossless`)")
    p.add_argument("--serve-args", default="", help="more arguments for both specformer serve sides, one string")
    p.add_argument("--llama-server", default=None, help="llama-server's executable: adds the llama side")
    p.add_argument("--llama-gguf", default=None, help="the float32 GGUF for llama-server (benchmarks/peers.py)")
    p.add_argument("--llama-args", default="", help="more arguments for llama-server, one string")
    p.add_argument("--label", default="", help="free text stored in the output")
    args = parse_with_prompts(p, argv)
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def settings(args) -> dict:
    keys = ("model", "batch_size", "context", "port", "concurrency", "llama_concurrency", "requests_per_level",
            "max_tokens", "temperature", "endpoint", "prompts", "timeout", "check_texts", "serve_args",
            "llama_server", "llama_gguf", "llama_args")
    return {k: getattr(args, k) for k in keys}


def planned_sides(args) -> dict:
    """name -> (command, concurrency levels), or None for a llama side that is skipped (with a line on stderr)."""
    sides: dict = {"spec": (our_command(args, "default"), args.concurrency),
                   "plain": (our_command(args, "none"), args.concurrency)}
    if args.llama_server and args.llama_gguf:
        sides["llama"] = (llama_command(args), args.llama_concurrency)
    else:
        why = "no --llama-server given" if not args.llama_server else "no --llama-gguf (float32 GGUF) given"
        print(f"serve_side_by_side: llama-server skipped: {why}", file=sys.stderr)
        sides["llama"] = None
    return sides


def run_all(args, doc: dict, logs: Path) -> dict:
    """Measure every side in turn into doc["sides"]; the texts of each side for the lossless check."""
    texts: dict = {}
    save = lambda: write_json(args.out, doc)
    for name, plan in planned_sides(args).items():
        if plan is None:
            doc["sides"][name] = {"status": "skipped"}
            continue
        cmd, levels = plan

        def keep(side: dict, name=name) -> None:
            doc["sides"][name] = side
            doc["ratios"] = ratios(doc["sides"], args.concurrency)
            save()

        try:
            _, texts[name] = measure_side(name, cmd, levels, args, args.prompt_list, logs / f"{name}.log", keep)
        except (SideError, LoadError) as e:
            print(f"serve_side_by_side: {name} failed: {e}", file=sys.stderr)
            doc["sides"][name] = doc["sides"].get(name, {}) | {"status": "error", "error": str(e)}
            save()
    return texts


def table(doc: dict) -> str:
    """A short text table of the levels and ratios."""
    sides, rows = doc["sides"], []
    levels = sorted({int(c) for s in sides.values() for c in s.get("levels", {})})
    head = ("C", "spec tok/s", "plain tok/s", "spec/plain", "spec ITL ms", "plain ITL ms", "plain/spec ITL",
            "llama tok/s", "spec/llama")
    for c in levels:
        r = doc["ratios"].get(str(c), {})
        rows.append((c, figure(sides.get("spec"), c, "tokens_per_s"), figure(sides.get("plain"), c, "tokens_per_s"),
                     r.get("spec_over_plain_tokens_per_s"), ms(figure(sides.get("spec"), c, "itl")),
                     ms(figure(sides.get("plain"), c, "itl")), r.get("itl_p50_plain_over_spec"),
                     figure(sides.get("llama"), c, "tokens_per_s"), r.get("spec_over_llama_tokens_per_s")))
    lines = ["  ".join(f"{h:>14}" for h in head)]
    lines += ["  ".join(f"{cell(v):>14}" for v in row) for row in rows]
    lines.append(f"lossless: {doc['lossless']}")
    lines += [f"{name}: {s['status']}" + (f" ({s['error'].splitlines()[0]})" if s.get("error") else "")
              for name, s in sides.items() if s["status"] != "ok"]
    return "\n".join(lines)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def cell(value) -> str:
    return "-" if value is None else str(value) if isinstance(value, int) else f"{value:.2f}"


def failures(doc: dict) -> int:
    """Failed requests over every level, plus one for each side that did not run to the end."""
    sides = doc["sides"].values()
    return (sum(run["results"]["failed"] for s in sides for run in s.get("levels", {}).values())
            + sum(s["status"] not in ("ok", "skipped") for s in sides))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="serve_side_by_side."))
    print(f"serve_side_by_side: server logs in {logs}", file=sys.stderr)
    doc = {"complete": False, "label": args.label,
           "command": shlex.join([sys.executable, *(sys.argv if argv is None else ["serve_side_by_side.py", *argv])]),
           "host": host_facts(), "versions": versions(args), "settings": settings(args), "sides": {}, "ratios": {},
           "lossless": {"checked": False}}
    write_json(args.out, doc)
    texts = run_all(args, doc, logs)
    if args.check_texts:
        doc["lossless"] = lossless(texts.get("spec"), texts.get("plain"))
    doc["ratios"], doc["complete"] = ratios(doc["sides"], args.concurrency), True
    write_json(args.out, doc)
    print(table(doc))
    return 0 if failures(doc) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
