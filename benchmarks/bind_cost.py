"""What binding the shipped drafter to the default model costs a decoding call (`SpecformerDrafts.bind`: the drafter's
weights packed for the CPU kernels, the target's head cut to the draft vocabulary), the first time in a process and
after, against what a call pays once the binding is kept (`engine/bound.py`).

    .venv/bin/python benchmarks/bind_cost.py --out benchmarks/results/bind_cost_cpu.json
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/bind_cost.py --out ...   # an older checkout's package

Why: every speculative `generate` bound its drafter anew, and the first bind of a process compiled each of jnp's
packing operations; both land in `run_seconds`. Figures are medians of `--repeats` calls (after the first).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax

import specformer_jax
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.cli.args import kind
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.drafts import kinds
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.files import write_json

try:
    from specformer_jax.decoding.engine.bound import BOUND
except ImportError:  # an older checkout, from before bindings were kept
    BOUND = None


def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(fn()))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=kind(POSITIVE_INT), default=1)
    ap.add_argument("--repeats", type=kind(POSITIVE_INT), default=9)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default").use_decoding_layout(args.batch_size)
    drafter = kinds.checked_drafter(resolve_drafter("default", model), model.cfg)
    plan = make_plan(model, 2, SamplingConfig(), 64)
    source = lambda: kinds.draft_source(drafter, None, model.cfg, None)  # what each call makes
    first = timed(lambda: source().bind(plan, model.params))
    again = [timed(lambda: source().bind(plan, model.params)) for _ in range(args.repeats)]
    if BOUND is not None:
        BOUND.get(source(), plan, model.params)
    kept = [timed(lambda: BOUND.get(source(), plan, model.params)) for _ in range(args.repeats)] if BOUND else [0.0]
    ms = lambda s: round(1e3 * s, 2)
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "package": os.path.dirname(specformer_jax.__file__), "layout": model.layout, "unit": "ms",
           "first_bind": ms(first), "bind": ms(statistics.median(again)),
           "kept": ms(statistics.median(kept)) if BOUND else None,
           "runs": {"bind": [ms(s) for s in again], "kept": [ms(s) for s in kept]}}
    write_json(args.out, doc)
    print(f"first bind {doc['first_bind']} ms, later binds {doc['bind']} ms, kept {doc['kept']} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
