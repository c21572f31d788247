"""How far ahead, and into which cache, the CPU matmul kernel should prefetch its weight stream, and how many rows
its register tiles should hold: `panel_stream.cc` (the kernel's packed-panel product over the default model's
matrices, outside XLA) built once per variant with `pallas_kernels/cpu.cc`'s settings overridden, the builds run in
turn `--repeats` times, and each pass's time by rows of x taken as the median over repeats.

    .venv/bin/python benchmarks/prefetch_sweep.py --variants 16:3,24:3,32:2,48:2,64:2 --repeats 3 \\
        --out benchmarks/results/prefetch_l2/prefetch_sweep_cpu.json

A variant `ROWS:LOCALITY[:TILE]` prefetches the panel row ROWS ahead of the one being read (a float32 panel row is
128 bytes) with `__builtin_prefetch`'s locality LOCALITY: 3 is `prefetcht0` (into L1), 2 `prefetcht1` (into L2), 1
`prefetcht2`; TILE, where given, is the rows of x a register tile holds (else the kernel's own for this CPU). Why:
decoding's passes stream 538 MB of weights for a few rows, so whether the rows' arithmetic hides under the stream
decides what a verified position costs.
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


def variant(text: str) -> tuple[int, int, int]:
    """ROWS:LOCALITY[:TILE] as (rows, locality, tile); tile 0: the kernel's own."""
    try:
        parts = [int(part) for part in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWS:LOCALITY[:TILE], e.g. 48:2 or 48:2:3")
    rows, locality, tile = (parts + [0])[:3]
    if rows < 0 or locality not in (0, 1, 2, 3) or not (len(parts) == 2 or 1 <= tile <= 32):
        raise argparse.ArgumentTypeError(f"{text!r}: ROWS must be >= 0, LOCALITY 0-3 and TILE 1-32")
    return rows, locality, tile


def name(rows: int, locality: int, tile: int) -> str:
    return f"{rows}:{locality}" + (f":{tile}" if tile else "")


def row_counts(text: str) -> str:
    """`--rows` as panel_stream.cc takes it: 1-64 rows a pass, comma-separated."""
    if not all(part.isdigit() and 1 <= int(part) <= 64 for part in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of 1-64, e.g. 1,4,8")
    return text


def build(compiler: str, rows: int, locality: int, tile: int, out: Path) -> None:
    cmd = [compiler, "-O3", "-march=native", "-std=gnu++17", "-pthread", "-w", f"-I{jax.ffi.include_dir()}",
           f"-DSPECFORMER_PREFETCH_ROWS={rows}", f"-DSPECFORMER_PREFETCH_LOCALITY={locality}",
           *([f"-DSPECFORMER_PANEL_ROWS={tile}"] if tile else []),
           str(ROOT / "benchmarks" / "panel_stream.cc"), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        fail(f"cannot run the compiler {compiler!r}: {e.strerror}")
    if done.returncode:
        fail(f"building {name(rows, locality, tile)} failed: {' '.join(done.stderr.split())[:400]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="16:3,48:2", help="ROWS:LOCALITY[:TILE],... (see the module's docstring)")
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
    times: dict[str, dict[str, list[float]]] = {name(*v): {} for v in variants}
    tiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            build(compiler, *v, Path(tmp) / name(*v))
        for _ in range(args.repeats):
            for v in variants:
                run = subprocess.run([str(Path(tmp) / name(*v)), args.rows], capture_output=True, text=True)
                if run.returncode:
                    fail(f"the {name(*v)} build failed: {' '.join(run.stderr.split())[:400]}")
                doc = json.loads(run.stdout)
                tiles[name(*v)] = doc["tile_rows"]
                for n, ways in doc["rows"].items():
                    times[name(*v)].setdefault(n, []).append(ways["kernel"])
    medians = {v: {n: round(statistics.median(ts), 2) for n, ts in by_rows.items()} for v, by_rows in times.items()}
    write_json(args.out, {
        "command": "python " + " ".join(sys.argv), "device": doc["device"], "cpu_count": os.cpu_count(),
        "compiler": doc["compiler"], "python": platform.python_version(), "repeats": args.repeats,
        "lanes": doc["lanes"], "tile_rows": tiles,
        "unit": "ms per pass over every matrix, median over repeats; keys: variant, then rows",
        "median_ms": medians, "runs_ms": times})
    for v, by_rows in medians.items():
        print(f"{v:>6} " + " ".join(f"{n}:{ms:.2f}" for n, ms in by_rows.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
