"""What a drafter costs per round, for the drafters of the v5 ablation side by side in one run on the default model
(or --model): the shipped drafter's shape, with a token input, with a draft vocabulary of V' tokens, with 8 slots.

    .venv/bin/python benchmarks/drafter_cost.py --out benchmarks/results/drafter_cost_cpu.json

Weights are random (cost does not depend on them); a draft vocabulary's ids are the V' lowest ids (cost does not
depend on which). "draft" times the draft source's draft alone (the drafter's context layer over one round's k + 1
tokens, its slots at one position, the head, the choice of drafts) as the engine calls it; with --rounds, "round"
is the engine's round with k drafts (verify, acceptance, drafting, bookkeeping), from measure_costs. Ratios are
against the first drafter.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.tuning.timing import measure_costs
from specformer_jax.modeling.drafter import drafter_cache, init_drafter
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.loaded import LoadedDrafter

ARMS = {  # name -> DrafterConfig settings ("draft_vocab:N": a draft vocabulary of N tokens)
    "v4": {}, "next_token": {"next_token_input": True}, "context_token": {"context_token_input": True},
    "k8": {"num_slots": 8},
}


def drafter_for(model, arm: str) -> LoadedDrafter:
    name, _, size = arm.partition(":")
    settings = {"draft_vocab_size": int(size)} if name == "draft_vocab" else ARMS[name]
    cfg = DrafterConfig(**{"num_slots": 4, **settings})
    if (cfg.draft_vocab_size or 0) >= model.cfg.vocab_size:
        raise SystemExit(f"{arm}: a draft vocabulary must be smaller than the model's ({model.cfg.vocab_size})")
    vocab = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) if cfg.draft_vocab_size else None
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(0), vocab), {})


def draft_seconds(model, drafter: LoadedDrafter, batch: int, k: int, context: int, repeats: int) -> float:
    """Median seconds of one call of the draft function on `batch` rows whose drafter cache holds `context`."""
    cfg, hooks = model.cfg, drafter.cfg.resolved_hooks(model.cfg)
    plan = make_plan(model, k, SamplingConfig(), 1)
    source = jax.jit(lambda s, p: s.bind(plan, p))(SpecformerDrafts(drafter.cfg, drafter.params), model.params)
    draft = jax.jit(lambda s, *a: s.draft(plan, *a))
    hidden = {i: jax.random.normal(jax.random.key(i), (batch, k + 1, cfg.hidden_size), cfg.dtype) for i in hooks}
    empty = drafter_cache(cfg, batch, context + k + 1)
    state = KVCache(empty.k, empty.v, jnp.full((batch,), context, jnp.int32))
    args = (source, hidden, state, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, 1), jnp.int32),
            jnp.ones((batch, k + 1), jnp.int32), jax.random.split(jax.random.key(0), batch))
    jax.block_until_ready(draft(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(draft(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="default")
    ap.add_argument("--arms", default="v4,draft_vocab:16384,draft_vocab:8192,next_token,context_token,k8",
                    help=f"drafters to time: {', '.join(ARMS)}, draft_vocab:N")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--draft-lens", default="1,4", help="k per round")
    ap.add_argument("--context", type=int, default=256, help="tokens in the caches")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", action="store_true", help="also time the engine's plain step and whole rounds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target(args.model)
    arms, ks = args.arms.split(","), [int(k) for k in args.draft_lens.split(",")]
    rows = []
    for batch in map(int, args.batch_sizes.split(",")):
        for arm in arms:
            drafter = drafter_for(model, arm)
            rows.append({"batch": batch, "drafter": arm,
                         "draft_seconds": {k: draft_seconds(model, drafter, batch, k, args.context, args.repeats)
                                           for k in ks}})
            if args.rounds:
                costs = measure_costs(model, drafter, batch, args.context)
                rows[-1] |= {"step_seconds": costs["step_seconds"],
                             "round_seconds": {k: costs["round_seconds"][k] for k in ks}}
            print(json.dumps(rows[-1]), file=sys.stderr)
    for r in rows:  # against the first drafter at the same batch
        first = next(f for f in rows if f["batch"] == r["batch"])
        for what in ("draft", "round") if args.rounds else ("draft",):
            r[f"{what}_vs_{arms[0]}"] = {k: round(r[f"{what}_seconds"][k] / first[f"{what}_seconds"][k], 3) for k in ks}
    dev = jax.devices()[0]
    result = {"command": " ".join(sys.argv), "device": dev.device_kind, "platform": dev.platform,
              "python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__,
              "model": model.source, "dtype": model.cfg.dtype, "vocab_size": model.cfg.vocab_size,
              "context": args.context, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
