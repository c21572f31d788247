"""How many SpecFormer drafts a hybrid's rounds verify when no row has n-gram drafts (`HYBRID_CPU_MODEL_DRAFTS` in
decoding/drafters.py), at batch 1 on a CPU: each value side by side with plain decoding and the SpecFormer drafter
alone, in one run with alternating repeats, tokens checked against plain decoding. Run on the development prompts,
not the benchmark sets:

    .venv/bin/python benchmarks/hybrid_model_len.py --out benchmarks/results/hybrid_model_len_dev_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import jax

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli.args import parse_drafter
from specformer_jax.decoding import drafters
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.encode import read_prompts_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="benchmarks/ngram/editing-dev.jsonl")
    ap.add_argument("--draft-len", type=int, default=7)
    ap.add_argument("--model-lens", default="2,3,4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    prompts = read_prompts_file(Path(args.prompts))
    hybrid, alone = parse_drafter("default+ngram", model), parse_drafter("default", model)
    sides = {"plain": ({}, None), "specformer@2": ({"drafter": alone, "draft_len": 2}, None)}
    sides |= {f"hybrid@{args.draft_len}, model_len {m}": ({"drafter": hybrid, "draft_len": args.draft_len}, m)
              for m in map(int, args.model_lens.split(","))}
    shipped = dict(drafters.HYBRID_CPU_MODEL_DRAFTS)

    def run(name):
        kw, m = sides[name]
        # the engine reads the table when it builds the draft source (drafters.hybrid_model_len), so a side sets it
        drafters.HYBRID_CPU_MODEL_DRAFTS = shipped if m is None else {1: m}
        return generate(model, prompts, batch_size=1, max_new_tokens=args.max_new_tokens, **kw)

    plain = run("plain").token_ids
    if any(run(name).token_ids != plain for name in sides):
        raise SystemExit("a speculative side's tokens differ from plain decoding")
    stats = {name: [] for name in sides}
    for i in range(args.repeats):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            stats[name].append(run(name).stats)
    tps = lambda name: [s["tokens_per_second"] for s in stats[name]]
    rows = {name: {"tokens_per_second": statistics.median(tps(name)),
                   "speedup": statistics.median(b / a for a, b in zip(tps("plain"), tps(name))),
                   "mean_accepted_length": stats[name][-1].get("mean_accepted_length", 1.0),
                   "tokens_per_second_runs": tps(name)} for name in sides}
    doc = {"command": " ".join(["benchmarks/hybrid_model_len.py", *sys.argv[1:]]),
           "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "jax": jax.__version__,
           "model": model.source, "prompts": args.prompts, "batch_size": 1, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print({name: (round(r["speedup"], 3), round(r["mean_accepted_length"], 3)) for name, r in rows.items()},
          file=sys.stderr)


if __name__ == "__main__":
    main()
