"""How far ahead, and into which cache, the CPU matmul kernel should prefetch its weight stream: `panel_stream.cc`
(the kernel's packed-panel product over the default model's matrices, outside XLA) built once per variant with
`pallas_kernels/cpu.cc`'s prefetch settings overridden, the builds run in turn `--repeats` times, and each pass's
time by rows of x taken as the median over repeats (tiles of 14 rows, the kernel's own).

    .venv/bin/python benchmarks/prefetch_sweep.py --variants 16:3,24:3,32:2,48:2,64:2 --repeats 3 \\
        --out benchmarks/results/prefetch_l2/prefetch_sweep_cpu.json

A variant `ROWS:LOCALITY` prefetches the panel row ROWS ahead of the one being read (a float32 panel row is 128
bytes) with `__builtin_prefetch`'s locality LOCALITY: 3 is `prefetcht0` (into L1), 2 `prefetcht1` (into L2), 1
`prefetcht2`. Why: decoding's passes stream 538 MB of weights for a few rows, so whether the rows' arithmetic hides
under the stream decides what a verified position costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import jax

from pallas_kernels.cpu import _compiler
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.cli.args import kind
from specformer_jax.files import write_json

ROOT = Path(__file__).resolve().parent.parent


def fail(message: str) -> NoReturn:
    """One line on stderr and exit 2, as for bad arguments."""
    print(f"prefetch_sweep: {message}", file=sys.stderr)
    raise SystemExit(2)


def variant(text: str) -> tuple[int, int]:
    try:
        rows, locality = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWS:LOCALITY, e.g. 48:2") from None
    if rows < 0 or locality not in (0, 1, 2, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: ROWS must be >= 0 and LOCALITY 0-3")
    return rows, locality


def row_counts(text: str) -> str:
    """`--rows` as panel_stream.cc takes it: 1-64 rows a pass, comma-separated."""
    if not all(part.isdigit() and 1 <= int(part) <= 64 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of 1-64, e.g. 1,4,8")
    return text


def build(compiler: str, rows: int, locality: int, out: Path) -> None:
    cmd = [compiler, "-O3", "-march=native", "-std=gnu++17", "-pthread", "-w", f"-I{jax.ffi.include_dir()}",
           f"-DSPECFORMER_PREFETCH_ROWS={rows}", f"-DSPECFORMER_PREFETCH_LOCALITY={locality}",
           str(ROOT / "benchmarks" / "panel_stream.cc"), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        fail(f"cannot run the compiler {compiler!r}: {e.strerror}")
    if done.returncode:
        fail(f"building {rows}:{locality} failed: {' '.join(done.stderr.split())[:400]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="16:3,48:2", help="ROWS:LOCALITY,... (see the module's docstring)")
    ap.add_argument("--rows", type=row_counts, default="1,2,3,4,6,8,14,22", help="rows of x per pass, e.g. 1,4,8")
    ap.add_argument("--repeats", type=kind(POSITIVE_INT), default=3, help="runs of each build, in turn")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    try:
        variants = [variant(v) for v in args.variants.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    try:
        compiler = _compiler()  # the one the kernels are built with
    except RuntimeError as e:
        fail(str(e))
    times: dict[str, dict[str, list[float]]] = {f"{r}:{loc}": {} for r, loc in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rows, locality in variants:
            build(compiler, rows, locality, Path(tmp) / f"ps_{rows}_{locality}")
        for _ in range(args.repeats):
            for rows, locality in variants:
                run = subprocess.run([str(Path(tmp) / f"ps_{rows}_{locality}"), args.rows], capture_output=True,
                                     text=True)
                if run.returncode:
                    fail(f"the {rows}:{locality} build failed: {' '.join(run.stderr.split())[:400]}")
                doc = json.loads(run.stdout)
                for n, ways in doc["rows"].items():
                    times[f"{rows}:{locality}"].setdefault(n, []).append(ways["tile14"])
    medians = {v: {n: round(statistics.median(ts), 2) for n, ts in by_rows.items()} for v, by_rows in times.items()}
    write_json(args.out, {
        "command": "python " + " ".join(sys.argv), "device": doc["device"], "cpu_count": os.cpu_count(),
        "compiler": doc["compiler"], "python": platform.python_version(), "repeats": args.repeats,
        "unit": "ms per pass over every matrix (tiles of 14 rows), median over repeats; keys: variant, then rows",
        "median_ms": medians, "runs_ms": times})
    for v, by_rows in medians.items():
        print(f"{v:>6} " + " ".join(f"{n}:{ms:.2f}" for n, ms in by_rows.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
