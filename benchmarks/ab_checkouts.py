"""`specformer bench` under two checkouts of the project, alternately, to see whether a change to the code changed
decoding speed: each repeat runs the same bench command with one checkout's package and then the other's (the order
reversed every other repeat), and the ratios are taken pair by pair, so a machine that slows down for a while slows
both sides of a pair.

    git worktree add /tmp/before <commit>   # or any clone of the older code
    .venv/bin/python benchmarks/ab_checkouts.py --before /tmp/before --after . --repeats 3 \\
        --out benchmarks/results/NAME.json -- --batch-sizes 1,8 --draft-len 4 --max-new-tokens 64 --repeats 3

Both checkouts run with this venv's Python and packages; only `specformer_jax` and `pallas_kernels` come from the
checkout (PYTHONPATH). Each run's file records which files it imported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = "import sys, specformer_jax; from specformer_jax.cli import main; print(specformer_jax.__file__); " \
      "sys.exit(main(sys.argv[1:]))"


def commit(checkout: Path) -> str:
    proc = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def bench(checkout: Path, args: list[str]) -> dict:
    """One `specformer bench` run with the checkout's package: its result document, and the package it imported."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = dict(os.environ, PYTHONPATH=str(checkout))
        proc = subprocess.run([sys.executable, "-c", RUN, "bench", *args, "--out", str(out)], env=env, cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"bench failed under {checkout}:\n{proc.stderr[-2000:]}")
        doc = json.loads(out.read_text())
    doc["imported"] = proc.stdout.strip().splitlines()[0]
    return doc


def side_rates(doc: dict) -> dict:
    """batch size -> {side: tokens/s} of one bench document."""
    return {r["batch_size"]: {side: r[side]["tokens_per_second"] for side in ("ar", "spec") if side in r}
            for r in doc["results"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--before", type=Path, required=True, help="checkout of the older code")
    ap.add_argument("--after", type=Path, required=True, help="checkout of the newer code")
    ap.add_argument("--repeats", type=int, default=3, help="bench runs of each checkout")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the `specformer bench` options")
    args = ap.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list] = {"before": [], "after": []}
    for i in range(args.repeats):
        for name in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
            runs[name].append(bench(sides[name], bench_args))
            print(f"{name} run {i + 1}: {side_rates(runs[name][-1])}", file=sys.stderr)
    ratios = {}
    for b in side_rates(runs["before"][0]):
        for side in side_rates(runs["before"][0])[b]:
            pairs = [side_rates(a)[b][side] / side_rates(o)[b][side] for a, o in zip(runs["after"], runs["before"])]
            ratios[f"batch {b} {side}"] = {"median": statistics.median(pairs), "runs": pairs}
    doc = {
        "command": "python benchmarks/ab_checkouts.py " + shlex.join(sys.argv[1:]),
        "what": "tokens/s of the newer checkout over the older one, per batch size and side (ar: plain decoding, "
                "spec: speculative), pair by pair",
        "before": {"checkout": str(sides["before"]), "commit": commit(sides["before"])},
        "after": {"checkout": str(sides["after"]), "commit": commit(sides["after"])},
        "after_over_before": ratios,
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "environment": {k: v for k, v in os.environ.items() if k.startswith("SPECFORMER_")},  # both sides ran with it
        "runs": runs,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(ratios, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
