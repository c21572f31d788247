"""Where a decoding step's time goes, operation by operation: `generate` traced (`jax.profiler`) at one batch size,
plain and speculative at the defaults, and each XLA operation's time summed by its kind (the name without its
number: `ffi_call` for the CPU kernels, `add_concatenate_fusion`, ...), per plain step and per round.

    .venv/bin/python benchmarks/trace_ops.py --batch-size 8 --prompts chat --out /tmp/ops_b8.json

Tracing slows every operation a little, so read the kinds against each other, not as tokens/s. The HLO behind a
kind: run the same decode with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" and look the fusion up in
DIR's `*run_chunk*after_optimizations.txt`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

import jax

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.bench.run import cycled
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.cli.args import kind
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.files import write_json

OP_NAME = re.compile(r"([a-z][a-z0-9_-]*)(?:\.\d+)?")  # an HLO instruction's name: its kind and a number


def op_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Microseconds and counts per operation kind in a jax.profiler trace (Python frames and runtime events
    left out)."""
    path = next(Path(trace_dir).rglob("*.trace.json.gz"))
    micros, counts = collections.Counter(), collections.Counter()
    for event in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]:
        op = OP_NAME.fullmatch(event.get("name", ""))
        if event.get("ph") != "X" or not op:
            continue
        base = op.group(1)
        micros[base] += event.get("dur", 0)
        counts[base] += 1
    return micros, counts


def side(model, prompts, batch_size: int, drafter: str | None) -> dict:
    """One side compiled by an untimed call, then traced: its per-step milliseconds by operation kind."""
    options = dict(batch_size=batch_size, max_new_tokens=64, drafter=drafter)
    generate(model, prompts, **options)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            stats = generate(model, prompts, **options).stats
        micros, counts = op_times(tmp)
    steps = stats["rounds_run"]
    ops = {name: {"ms_per_step": round(micros[name] / steps / 1e3, 4), "per_step": round(counts[name] / steps, 2)}
           for name in sorted(micros, key=micros.get, reverse=True)}
    keep = ("tokens_per_second", "rounds_run", "mean_accepted_length", "draft_len", "verify_budget")
    return {"stats": {k: stats.get(k) for k in keep}, "ms_per_step": round(sum(micros.values()) / steps / 1e3, 3),
            "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=kind(POSITIVE_INT), default=8)
    ap.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="chat")
    ap.add_argument("--requests-per-slot", type=kind(POSITIVE_INT), default=2,
                    help="requests decoded: this many times the batch size (the prompts cycled)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    prompts = read_prompts_file(PROMPT_SETS[args.prompts])
    prompts = cycled(prompts, args.requests_per_slot * args.batch_size)
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "python": platform.python_version(), "jax": jax.__version__, "batch_size": args.batch_size,
           "prompts": args.prompts, "num_requests": len(prompts),
           "plain": side(model, prompts, args.batch_size, None),
           "spec": side(model, prompts, args.batch_size, "default")}
    write_json(Path(args.out), doc)
    for name in ("plain", "spec"):
        top = list(doc[name]["ops"].items())[:8]
        print(f"{name}: {doc[name]['ms_per_step']:.1f} ms a step; " +
              ", ".join(f"{op} {v['ms_per_step']:.2f}" for op, v in top))


if __name__ == "__main__":
    main()
