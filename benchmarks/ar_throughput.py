"""Plain (AR) decoding throughput of `specformer_jax.generate` on the machine at hand, per batch size.

Usage: python benchmarks/ar_throughput.py [--model default] [--batch-sizes 1,8] [--max-new-tokens 64] --out FILE.json
Compile time is excluded (measured separately); each batch size runs the same prompts (benchmarks/prompts.jsonl).
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

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import read_prompts_file
from specformer_jax.decoding.api import generate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).parent / "prompts.jsonl")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = load_target(args.model)
    prompts = read_prompts_file(args.prompts)
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        kw = dict(max_new_tokens=args.max_new_tokens, batch_size=bs)
        generate(model, prompts[:bs], **kw)  # compile and warm up every shape used below
        s = generate(model, prompts, **kw).stats
        rows.append({k: s[k] for k in ("batch_size", "num_prompts", "num_generated", "tokens_per_second", "run_seconds")})
        print(json.dumps(rows[-1]), file=sys.stderr)
    out = {
        "command": "python " + " ".join(sys.argv),
        "model": args.model,
        "dtype": model.cfg.dtype,
        "max_new_tokens": args.max_new_tokens,
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
