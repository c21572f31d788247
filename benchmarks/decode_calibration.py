"""Whether the drafter's calibration holds while decoding: every draft a round with a verify budget chose, its value
(the calibrated chance that it and the drafts before it are accepted: engine/budget.py) against whether the target
accepted it, binned by value, for the defaults at one batch size on a prompt set.

    .venv/bin/python benchmarks/decode_calibration.py --batch-size 8 --prompts chat \\
        --out benchmarks/results/NAME.json

Why: `specformer eval-drafter` fits the calibration teacher-forced on held-out data; the budget ranks drafts by it
on prompts it never saw, after the drafter's own earlier drafts. If the values ran above what decoding accepts, a
recalibration (or a margin) would verify fewer, likelier drafts. The values come out of the compiled round through
`jax.debug.callback` (one call a round), so this run's speed says nothing. Its tokens are checked against plain
decoding.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.engine import chunk
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.files import write_json
from specformer_jax.training.data.prompts import read_prompts_file

EDGES = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0001)
ROUNDS: list[list[np.ndarray]] = []
_FLAT_PASS = chunk._flat_pass


def _recorded_flat_pass(plan, params, source, accept, s, drafts, q, keys, live, values, budget):
    """`chunk._flat_pass`, handing each round's values, choices and accepted counts to the host."""
    n, final, cache, hidden, chosen = _FLAT_PASS(plan, params, source, accept, s, drafts, q, keys, live, values,
                                                 budget)
    jax.debug.callback(lambda *a: ROUNDS.append([np.asarray(x) for x in a]), values, jnp.max(q, axis=-1), chosen,
                       n, live)
    return n, final, cache, hidden, chosen


def _drafts() -> dict[str, np.ndarray]:
    """Every verified draft of the recorded rounds: its value, slot, raw confidence and whether it was accepted."""
    rows = [(values[b, i], i, raw[b, i], n[b] > i) for values, raw, chosen, n, live in ROUNDS
            for b in np.nonzero(live)[0] for i in range(chosen[b])]
    value, slot, raw, accepted = (np.asarray(c) for c in zip(*rows))
    return {"value": value, "slot": slot, "raw": raw, "accepted": accepted}


def _summary(d: dict[str, np.ndarray]) -> dict:
    bins = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (d["value"] >= lo) & (d["value"] < hi)
        if m.any():
            bins.append({"value_from": lo, "value_to": min(hi, 1.0), "drafts": int(m.sum()),
                         "mean_value": round(float(d["value"][m].mean()), 4),
                         "accepted": round(float(d["accepted"][m].mean()), 4)})
    slots = [{"slot": i + 1, "drafts": int((d["slot"] == i).sum()),
              "mean_value": round(float(d["value"][d["slot"] == i].mean()), 4),
              "mean_raw_confidence": round(float(d["raw"][d["slot"] == i].mean()), 4),
              "accepted": round(float(d["accepted"][d["slot"] == i].mean()), 4)}
             for i in range(int(d["slot"].max()) + 1)]
    return {"rounds": len(ROUNDS), "verified_drafts": int(d["value"].size),
            "sum_of_values": round(float(d["value"].sum()), 2), "accepted_drafts": int(d["accepted"].sum()),
            "by_slot": slots, "by_value": bins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="chat")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    drafter = resolve_drafter("default", model)
    prompts = read_prompts_file(PROMPT_SETS[args.prompts])
    kw = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False)
    plain = generate(model, prompts, drafter=None, **kw)
    chunk._flat_pass = _recorded_flat_pass
    spec = generate(model, prompts, drafter=drafter, **kw)
    if not spec.stats.get("verify_budget"):
        sys.exit(f"decode_calibration: batch {args.batch_size} verifies no budget by default: nothing to bin")
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "batch_size": args.batch_size, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
           "draft_len": spec.stats["draft_len"], "verify_budget": spec.stats["verify_budget"],
           "equal_to_plain": spec.token_ids == plain.token_ids,
           "mean_accepted_length": spec.stats["mean_accepted_length"], **_summary(_drafts())}
    write_json(args.out, doc)
    print(f"{doc['verified_drafts']} drafts verified, values summing to {doc['sum_of_values']}, "
          f"{doc['accepted_drafts']} accepted", file=sys.stderr)
    for b in doc["by_value"]:
        print(f"  value {b['value_from']:.2f}-{b['value_to']:.2f}: {b['drafts']:4d} drafts, mean value "
              f"{b['mean_value']:.3f}, accepted {b['accepted']:.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()
