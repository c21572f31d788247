"""A soak test of `specformer serve`: long streamed load with bad requests and clients that hang up, to check that
the server answers every request, frees every slot and does not grow in memory.

What it does: it starts one server (`specformer serve --port P --batch-size S` plus `--serve-args`), waits until
GET /health answers 200, warms it up (2*C requests at concurrency C, 8 tokens each, not measured), then makes
`--runs` runs of benchmarks/bench_serve.py's `run_load`: `--num-requests` streamed requests at `--concurrency` C,
temperature 0, `--max-tokens` each, with `--malformed-fraction` of them sent broken (each must get HTTP 400) and
`--abandon-fraction` of the valid ones closed by the client after their first tokens. After the warm-up and after
each run it records:

- the server process's resident memory: VmRSS and VmHWM (peak) of /proc/<pid>/status, in MiB, where the pid is
  the process that listens on the port (the server itself, not a wrapper that started it);
- from GET /metrics: specformer_slots_busy, specformer_queue_length, every specformer_requests_total{finish=...}
  and specformer_requests_invalid_total.

After each run it also reads /metrics at once ("after run N, at once"), then polls it for up to 30 s until
specformer_slots_busy is 0 (a slot whose client hung up is freed at the next chunk boundary) and records how long that
took (`drain` of each run) and what the server counted during the run (`server_counts`); the "after run N" memory
and metrics are read after that wait.

Why: a benchmark run is short and its clients well behaved. A server that leaks a slot on every abandoned stream, or
some memory on every request, passes short runs and fails after hours in use. Two long runs with the same load show
such a leak as busy slots after the load ends or as memory that keeps growing after the first run (the first run
may still grow: compiled shapes, caches, allocator pools).

    .venv/bin/python benchmarks/serve_soak.py --out benchmarks/results/serve_soak_cpu.json

`verdict` in the JSON (`--out`, rewritten atomically after every step, "complete": false until the end):
every_valid_completed (no request failed in any run), every_malformed_400 (every broken request got 400),
no_slot_leak (slots_busy back to 0 after every run), rss_growth_mib (RSS after the last run minus after run 1) and
memory_flat (that growth <= `--max-growth-mib`). `--server-cmd 'CMD ... {port}'` runs another server instead (e.g.
another checkout's); one left running by a wrapper that does not pass on SIGTERM is stopped too. Server output goes
to a temporary directory, printed at the start. A summary goes to stdout at the end.
Exit status: 0 when every verdict holds, 1 otherwise (also when the soak could not run to the end).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import (  # noqa: E402
    DEFAULT_PROMPTS,
    LoadError,
    bounded,
    host_facts,
    parse_with_prompts,
    run_load,
    write_json,
)
from serve_side_by_side import (  # noqa: E402
    STOP_TIMEOUT_S,
    SideError,
    measured,
    port_number,
    positive,
    server,
    versions,
)

WARMUP_MAX_TOKENS = 8
DRAIN_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.25
GAUGES = ("specformer_slots_busy", "specformer_queue_length")
COUNTERS = ("specformer_requests_total{", "specformer_requests_invalid_total")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


# ---- the server and what it holds -------------------------------------------------------------------------------


def server_command(args) -> list[str]:
    """`specformer serve` with --port and --batch-size, or --server-cmd with {port} filled in."""
    if args.server_cmd:
        return [part.replace("{port}", str(args.port)) for part in shlex.split(args.server_cmd)]
    return [sys.executable, "-m", "specformer_jax.cli", "serve", "--port", str(args.port), "--batch-size",
            str(args.batch_size), *shlex.split(args.serve_args)]


def listening_sockets(port: int) -> set[str]:
    """The inodes of the TCP sockets that listen on `port` (IPv4 and IPv6), as /proc/<pid>/fd links name them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(f"socket:[{fields[9]}]")
    return found


def listener_pid(port: int) -> int | None:
    """The pid of the process that listens on `port`, or None when none of ours can be found."""
    sockets = listening_sockets(port)
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) in sockets:
                return int(fd.parts[2])
        except OSError:
            continue
    return None


def memory_mib(pid: int | None) -> dict:
    """VmRSS and VmHWM of a process in MiB (None each when it cannot be read, e.g. the process is gone)."""
    out: dict = {"rss": None, "hwm": None}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines() if pid else []
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "hwm"] = round(int(value.split()[0]) / 1024, 1)  # kB
    return out


def command_line(pid: int | None) -> str | None:
    """A process's command line, or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, TypeError):
        return None


def stop_left_over(pid: int | None, cmdline: str | None) -> None:
    """Stop the server if it outlived the command that started it (a wrapper such as `sh -c` that does not pass on
    SIGTERM): SIGTERM, then SIGKILL after STOP_TIMEOUT_S. Nothing when it is gone, as it is without a wrapper."""
    if pid is None or cmdline is None or command_line(pid) != cmdline:
        return
    print(f"serve_soak: the server (pid {pid}) outlived its wrapper: stopping it", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while command_line(pid) == cmdline and time.monotonic() < deadline:
        time.sleep(0.5)
    if command_line(pid) == cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---- /metrics ---------------------------------------------------------------------------------------------------


def number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() else value


def watched_metrics(text: str) -> dict:
    """The series we watch from Prometheus text, by their full name (labels included) -> value."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name in GAUGES or name.startswith(COUNTERS):
            values[name] = number(value)
    return values


def read_metrics(url: str) -> dict:
    """The watched series of GET /metrics, or {"error": ...} when the server does not answer."""
    try:
        response = httpx.get(url + "/metrics", timeout=10, trust_env=False)
        response.raise_for_status()
    except httpx.HTTPError as e:
        return {"error": f"GET /metrics: {e}"}
    return watched_metrics(response.text)


def wait_drained(url: str) -> tuple[dict, dict]:
    """Poll /metrics until specformer_slots_busy is 0 (at most DRAIN_TIMEOUT_S); how it went and the last values."""
    t0 = time.perf_counter()
    while True:
        values = read_metrics(url)
        waited = time.perf_counter() - t0
        busy = values.get("specformer_slots_busy")
        if busy == 0 or waited >= DRAIN_TIMEOUT_S:
            return {"drained": busy == 0, "seconds": round(waited, 3), "slots_busy": busy,
                    "queue_length": values.get("specformer_queue_length")}, values
        time.sleep(DRAIN_POLL_S)


def counter_deltas(before: dict, after: dict) -> dict:
    """How much each counter grew between two snapshots: what the server counted during one run."""
    return {k: v - before.get(k, 0) for k, v in after.items()
            if k.startswith(COUNTERS) and isinstance(before.get(k, 0), (int, float))}


# ---- the soak ---------------------------------------------------------------------------------------------------


class Soak:
    """One soak against a running server: records into `doc` and saves it after every step."""

    def __init__(self, args, doc: dict, pid: int | None):
        self.args, self.doc, self.pid = args, doc, pid
        self.url = f"http://127.0.0.1:{args.port}"
        self.t0 = time.perf_counter()

    def save(self) -> None:
        write_json(self.args.out, self.doc)

    def record(self, when: str, values: dict, memory: bool = True) -> None:
        """A /metrics snapshot (and the server's memory) labelled `when`."""
        elapsed = round(time.perf_counter() - self.t0, 1)
        self.doc["metrics"].append({"when": when, "elapsed_s": elapsed, "values": values})
        if memory:
            self.doc["memory_mib"].append({"when": when, "elapsed_s": elapsed, **memory_mib(self.pid)})
        self.save()

    def load(self, label: str, **kw) -> dict:
        a = self.args
        settings = dict(prompts=a.prompt_list, prompts_path=a.prompts, concurrency=a.concurrency,
                        temperature=0.0, timeout=a.timeout, label=label)
        return run_load(self.url, **(settings | kw))

    def warm_up(self) -> None:
        warm = self.load("warm-up", num_requests=2 * self.args.concurrency, max_tokens=WARMUP_MAX_TOKENS,
                         progress=False)
        self.doc["warmup"] = {k: warm["results"][k] for k in ("completed", "failed", "duration_s")}
        self.record("after warm-up", read_metrics(self.url))

    def run(self, i: int) -> None:
        a, before = self.args, self.doc["metrics"][-1]["values"]
        result = measured(self.load(f"run {i}", num_requests=a.num_requests, max_tokens=a.max_tokens,
                                    malformed_fraction=a.malformed_fraction, abandon_fraction=a.abandon_fraction))
        self.record(f"after run {i}, at once", read_metrics(self.url), memory=False)
        result["drain"], values = wait_drained(self.url)
        result["server_counts"] = counter_deltas(before, values)
        self.doc["runs"].append(result)
        self.record(f"after run {i}", values)
        print(f"serve_soak: {run_line(i, result)}", file=sys.stderr, flush=True)


def soak(args, doc: dict, log: Path) -> None:
    """Start the server, warm it up and make every run, recording into doc (doc["error"] when it cannot go on)."""
    cmd = server_command(args)
    print(f"serve_soak: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    pid = cmdline = None
    try:
        with server(cmd, args.port, log) as startup_s:
            pid = listener_pid(args.port)
            cmdline = command_line(pid)
            doc["server"] = {"startup_s": startup_s, "pid": pid, "cmdline": cmdline}
            if pid is None:
                print(f"serve_soak: no process of ours listens on port {args.port}: memory not read", file=sys.stderr)
            s = Soak(args, doc, pid)
            s.warm_up()
            for i in range(1, args.runs + 1):
                s.run(i)
    except (SideError, LoadError) as e:
        print(f"serve_soak: {e}", file=sys.stderr)
        doc["error"] = str(e)
    finally:
        stop_left_over(pid, cmdline)


# ---- the verdict ------------------------------------------------------------------------------------------------


def verdict(doc: dict, planned_runs: int, max_growth_mib: float) -> dict:
    """The checks of the soak (see the module's docstring); `passed` when every one holds and every run ran."""
    runs = doc["runs"]
    rss = {m["when"]: m["rss"] for m in doc["memory_mib"]}
    first, last = rss.get("after run 1"), rss.get(f"after run {len(runs)}")
    growth = round(last - first, 1) if first is not None and last is not None else None
    out = {"every_valid_completed": bool(runs) and all(r["results"]["failed"] == 0 for r in runs),
           "every_malformed_400": bool(runs) and all(
               r["results"]["malformed_rejected_400"] == r["results"]["malformed_sent"] for r in runs),
           "no_slot_leak": bool(runs) and all(r["drain"]["slots_busy"] == 0 for r in runs),
           "rss_growth_mib": growth, "memory_flat": growth is not None and growth <= max_growth_mib}
    out["passed"] = (len(runs) == planned_runs and not doc.get("error")
                     and all(v for k, v in out.items() if k != "rss_growth_mib"))
    return out


def run_line(i: int, r: dict) -> str:
    res, drain = r["results"], r["drain"]
    tok_s = res["output_tokens_per_s"]
    return (f"run {i}: {res['completed']} completed, {res['abandoned']} abandoned, {res['malformed_rejected_400']}/"
            f"{res['malformed_sent']} malformed refused, {res['failed']} failed in {res['duration_s']:.1f} s "
            f"({'-' if tok_s is None else f'{tok_s:.1f}'} tokens/s); slots busy after: {drain['slots_busy']} "
            f"({'drained' if drain['drained'] else 'NOT drained'} after {drain['seconds']:.2f} s)")


def summary(doc: dict) -> str:
    lines = [run_line(i, r) for i, r in enumerate(doc["runs"], 1)]
    lines += [f"memory {m['when']}: RSS {m['rss']} MiB, peak {m['hwm']} MiB" for m in doc["memory_mib"]]
    lines += [f"{k}: {v}" for k, v in doc["verdict"].items()]
    if doc.get("error"):
        lines.append(f"error: {doc['error'].splitlines()[0]}")
    return "\n".join(lines)


# ---- the command line -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Soak specformer serve: long streamed load with malformed and abandoned "
                                            "requests; checks every request is answered, no slot leaks, memory flat.")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--batch-size", type=positive(int), default=16, help="server slots (specformer serve)")
    p.add_argument("--serve-args", default="", help="more arguments for specformer serve, one string")
    p.add_argument("--server-cmd", default=None,
                   help="run this server instead of specformer serve (one string, {port} replaced by --port; "
                        "--batch-size and --serve-args then unused)")
    p.add_argument("--port", type=port_number, default=8012)
    p.add_argument("--runs", type=positive(int), default=2)
    p.add_argument("--num-requests", type=positive(int), default=1000, help="requests a run")
    p.add_argument("--concurrency", type=positive(int), default=16, help="requests in flight (warm-up: 2*this)")
    p.add_argument("--malformed-fraction", type=bounded(float, 0, 1), default=0.1)
    p.add_argument("--abandon-fraction", type=bounded(float, 0, 1), default=0.1)
    p.add_argument("--max-tokens", type=positive(int), default=32)
    p.add_argument("--max-growth-mib", type=bounded(float, 0), default=64.0,
                   help="most RSS growth from after run 1 to after the last run for memory_flat")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="a JSONL file of {\"prompt\": ...} lines")
    p.add_argument("--timeout", type=positive(float), default=600.0, help="seconds a request")
    p.add_argument("--label", default="", help="free text stored in the output")
    return parse_with_prompts(p, argv)


def settings(args) -> dict:
    keys = ("batch_size", "serve_args", "server_cmd", "port", "runs", "num_requests", "concurrency",
            "malformed_fraction", "abandon_fraction", "max_tokens", "max_growth_mib", "prompts", "timeout")
    return {k: getattr(args, k) for k in keys} | {"temperature": 0.0, "warmup_requests": 2 * args.concurrency,
                                                  "warmup_max_tokens": WARMUP_MAX_TOKENS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = Path(tempfile.mkdtemp(prefix="serve_soak.")) / "server.log"
    print(f"serve_soak: server log in {log}", file=sys.stderr)
    doc = {"complete": False, "label": args.label,
           "command": shlex.join([sys.executable, *(sys.argv if argv is None else ["serve_soak.py", *argv])]),
           "host": host_facts(), "versions": versions(argparse.Namespace(llama_server=None)),
           "settings": settings(args), "server_command": shlex.join(server_command(args)), "server_log": str(log),
           "server": None, "error": None, "warmup": None, "memory_mib": [], "runs": [], "metrics": [], "verdict": {}}
    write_json(args.out, doc)
    soak(args, doc, log)
    doc["verdict"], doc["complete"] = verdict(doc, args.runs, args.max_growth_mib), True
    write_json(args.out, doc)
    print(summary(doc))
    return 0 if doc["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
