"""Plain (AR) vs speculative greedy decoding on the machine at hand: same prompts, same process, per batch size.

Usage: python benchmarks/decode_throughput.py [--model default] [--drafter default|DIR|none] [--draft-len K]
           [--batch-sizes 1,8] [--max-new-tokens 64] --out FILE.json
Compile time is excluded (every shape is compiled by a warm-up call first). Prompts: benchmarks/prompts.jsonl,
written for this project and never used for drafter training.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import flax
import jax

from specformer_jax.checkpoints.drafter_io import load_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import read_prompts_file
from specformer_jax.decoding.api import generate

KEEP = ("tokens_per_second", "run_seconds", "num_generated", "mean_accepted_length", "acceptance_rate_per_slot", "rounds")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafter", default="default", help="'none' measures AR decoding only")
    ap.add_argument("--draft-len", type=int, default=None)
    ap.add_argument("--prompts", type=Path, default=Path(__file__).parent / "prompts.jsonl")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = load_target(args.model)
    drafter = None if args.drafter == "none" else load_drafter(args.drafter, model)
    prompts = read_prompts_file(args.prompts)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        row = {"batch_size": bs}
        ar = None
        for name, d in (("ar", None), ("spec", drafter)):
            if name == "spec" and d is None:
                continue
            kw = dict(max_new_tokens=args.max_new_tokens, batch_size=bs, drafter=d, draft_len=args.draft_len)
            generate(model, prompts[:bs], **kw)  # compile every shape used below
            res = generate(model, prompts, **kw)
            row[name] = {k: res.stats[k] for k in KEEP if k in res.stats}
            if name == "ar":
                ar = res.token_ids
            else:
                row["speedup"] = row["spec"]["tokens_per_second"] / row["ar"]["tokens_per_second"]
                row["output_equivalence"] = sum(a == b for a, b in zip(ar, res.token_ids)) / len(ar)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    out = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "drafter": args.drafter,
        "draft_len": args.draft_len if args.draft_len is not None else (drafter.cfg.num_slots if drafter else 0),
        "dtype": model.cfg.dtype,
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": len(prompts),
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
