"""What a chunk narrower than its plan pays for drafting: the server's pool with eight live rows, planned for 4 drafts
a row (the most any count of live rows verifies) and verifying the 2 a row under 14 positions that eight rows get,
with the drafter drafting all 4 slots each round (as before `chunk.drafted_width`) against only the 2 it verifies,
and a pool planned for 2 as the reference. One process, the three sides in turn, `--repeats` times.

    git apply benchmarks/results/live_rounds/drafted_width.patch   # the change measured; not merged
    .venv/bin/python benchmarks/results/live_rounds/drafted_width.py --out /tmp/drafted_width_cpu_b8.json

Each side decodes the chat prompts (cycled to `--num-requests`) on a pool of `--batch-size` rows with the shipped
drafter, every chunk at width 2 and the budget (Engine.chunk forced, as the server passes them); each side has its
own compile cache, so the variants do not share compiled chunks, and compilation is left out of the times
(`run_seconds`). Every side's tokens must equal the first's (greedy).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import jax

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.bench.run import cycled
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.drafts import kinds
from specformer_jax.decoding.encode import encode_prompts, read_prompts_file
from specformer_jax.decoding.engine import chunk, runner, scheduler
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.files import write_json

SIDES = {"planned 4, drafts 4": (4, False), "planned 4, drafts 2": (4, True), "planned 2": (2, True)}


def side(model, source_of, ids, k: int, narrow: bool, args, cache) -> tuple[float, list]:
    """(tokens/s, token ids) of one decoding of `ids` by a pool planned for k drafts, chunks at width 2."""
    real_chunk, real_width = scheduler.Engine.chunk, chunk.drafted_width
    scheduler.Engine.chunk = lambda self: real_chunk(self, 2, None, args.budget)
    chunk.drafted_width = real_width if narrow else (lambda plan, source, width: plan.draft_len)
    runner.COMPILED = cache
    try:
        plan = make_plan(model, k, SamplingConfig(), args.max_new_tokens)
        keys = jax.random.split(jax.random.key(0), len(ids))
        run = scheduler.run_to_end(scheduler.decode_requests(plan, model.params, source_of(plan), ids,
                                                             args.batch_size, keys))
    finally:
        scheduler.Engine.chunk, chunk.drafted_width = real_chunk, real_width
    return sum(map(len, run.token_ids)) / run.run_seconds, run.token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--budget", type=int, default=14)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    model.use_decoding_layout(args.batch_size, None)
    drafter = resolve_drafter("default", model)
    source_of = lambda plan: kinds.draft_source(drafter, None, model.cfg, None)
    ids = encode_prompts(model, cycled(read_prompts_file(PROMPT_SETS["chat"]), args.num_requests), True)
    caches = {name: runner.CompiledFunctions() for name in SIDES}
    runs, first = {name: [] for name in SIDES}, None
    for i in range(args.repeats + 1):  # the first round of sides compiles and is not counted
        for name, (k, narrow) in list(SIDES.items())[:: 1 if i % 2 else -1]:
            tps, tokens = side(model, source_of, ids, k, narrow, args, caches[name])
            first = first or tokens
            assert tokens == first, f"{name}: tokens differ from the first side's"
            if i:
                runs[name].append(tps)
            print(f"{name}: {tps:.1f} tok/s", file=sys.stderr)
    med = {name: statistics.median(v) for name, v in runs.items()}
    base = med["planned 4, drafts 4"]
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "settings": vars(args), "tokens_per_second": med, "runs": runs,
           "ratios_to_drafting_4": {name: v / base for name, v in med.items()}, "tokens_equal": True}
    write_json(args.out, doc)
    print(", ".join(f"{name}: {v / base:.3f}x" for name, v in med.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
