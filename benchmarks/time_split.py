"""Where decoding's time goes: prefill (the engine's `fill`) against chunks of rounds (`chunk`), plain and speculative
decoding side by side in one process, on a prompt set at one batch size with the defaults.

    .venv/bin/python benchmarks/time_split.py --batch-size 2 --prompts chat \\
        --out benchmarks/results/time_split_cpu_b2_chat.json

Why: `specformer bench`'s ratio is of whole runs, prefill included, and `specformer profile-round` times one round
on a prefilled pool; this says how far prefill dilutes the ratio of the rounds, and what a round costs in plain
steps while decoding real prompts (chunk seconds over rounds run, speculative over plain). Timers wrap the engine's
`fill` and `chunk` (each waits for the device); what is left of the wall time is the host's. Each side runs
`--repeats` times after one untimed run, alternating; figures are medians.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time

import jax

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.bench.run import cycled
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.cli.args import kind
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.engine import scheduler
from specformer_jax.files import write_json
from specformer_jax.training.data.prompts import read_prompts_file

SECONDS: collections.Counter = collections.Counter()


def _timed(name: str, method):
    def run(engine, *args, **kwargs):
        t = time.perf_counter()
        out = method(engine, *args, **kwargs)
        jax.block_until_ready(engine.pool.done)
        SECONDS[name] += time.perf_counter() - t
        return out
    return run


def _side(model, prompts, drafter: str, batch_size: int, max_new_tokens: int) -> dict:
    SECONDS.clear()
    t = time.perf_counter()
    stats = generate(model, prompts, drafter=drafter, batch_size=batch_size, max_new_tokens=max_new_tokens,
                     progress=False).stats
    wall = time.perf_counter() - t
    return {"wall": wall, "fill": SECONDS["fill"], "chunk": SECONDS["chunk"],
            "host": wall - SECONDS["fill"] - SECONDS["chunk"], "rounds_run": stats["rounds_run"],
            "num_generated": stats["num_generated"], "mean_accepted_length": stats.get("mean_accepted_length")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="chat")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-requests", type=kind(POSITIVE_INT), default=None,
                    help="the prompts cycled to this many requests (as in specformer bench; default: the prompts)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    scheduler.Engine.fill = _timed("fill", scheduler.Engine.fill)
    scheduler.Engine.chunk = _timed("chunk", scheduler.Engine.chunk)
    model = load_target("default")
    prompts = read_prompts_file(PROMPT_SETS[args.prompts])
    if args.num_requests:
        prompts = cycled(prompts, args.num_requests)
    runs = {"plain": [], "spec": []}
    for i in range(args.repeats + 1):
        for side, drafter in (("plain", "none"), ("spec", "default"))[:: 1 if i % 2 else -1]:
            run = _side(model, prompts, drafter, args.batch_size, args.max_new_tokens)
            if i:
                runs[side].append(run)
    med = {side: {key: statistics.median(r[key] for r in rs) for key in ("wall", "fill", "chunk", "host")}
           for side, rs in runs.items()}
    for side, rs in runs.items():
        med[side].update({k: rs[0][k] for k in ("rounds_run", "num_generated", "mean_accepted_length")})
        med[side]["fill_share"] = med[side]["fill"] / med[side]["wall"]
        med[side]["ms_per_round"] = 1e3 * med[side]["chunk"] / med[side]["rounds_run"]
    plain, spec = med["plain"], med["spec"]
    ratios = {"whole": plain["wall"] / spec["wall"], "chunks": plain["chunk"] / spec["chunk"],
              "round_in_plain_steps": spec["ms_per_round"] / plain["ms_per_round"]}
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "batch_size": args.batch_size, "prompts": args.prompts, "num_requests": len(prompts),
           "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "sides": med, "runs": runs, "ratios": ratios}
    write_json(args.out, doc)
    for side in ("plain", "spec"):
        m = med[side]
        print(f"{side:5s} wall {m['wall']:6.2f} s  fill {m['fill']:5.2f} ({m['fill_share']:.0%})  chunks "
              f"{m['chunk']:6.2f}  host {m['host']:4.2f}  {m['ms_per_round']:.1f} ms a round", file=sys.stderr)
    print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
