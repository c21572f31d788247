"""How many SpecFormer drafts a hybrid's rounds verify when no row has n-gram drafts (`HYBRID_CPU_MODEL_DRAFTS` in
specformer_jax/defaults.py), at batch 1 on a CPU: each value side by side with plain decoding and the SpecFormer drafter
alone, in one run with alternating repeats, tokens checked against plain decoding. Run on the development prompts,
not the benchmark sets:

    .venv/bin/python benchmarks/hybrid_model_len.py --out benchmarks/results/hybrid_model_len_dev_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_decode import batch_row  # noqa: E402

from specformer_jax import defaults, resolve_drafter  # noqa: E402
from specformer_jax.checkpoints.loader import load_target  # noqa: E402
from specformer_jax.decoding.encode import read_prompts_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--prompts", default="benchmarks/ngram/editing-dev.jsonl")
    ap.add_argument("--draft-len", type=int, default=7)
    ap.add_argument("--model-lens", default="2,3,4")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    prompts = read_prompts_file(Path(args.prompts))
    hybrid, alone = resolve_drafter("default+ngram", model), resolve_drafter("default", model)
    options = {"plain": {}, "specformer@2": {"drafter": alone, "draft_len": 2}}
    model_lens = {f"hybrid@{args.draft_len}, model_len {m}": m for m in map(int, args.model_lens.split(","))}
    options |= {name: {"drafter": hybrid, "draft_len": args.draft_len} for name in model_lens}
    shipped = dict(defaults.HYBRID_CPU_MODEL_DRAFTS)

    def prepare(name):  # read when generate builds the draft source (decoding/tuning/draft_len.py, hybrid_model_len)
        defaults.HYBRID_CPU_MODEL_DRAFTS = {1: model_lens[name]} if name in model_lens else shipped

    row = batch_row(model, prompts, 1, args.max_new_tokens, options, args.repeats, prepare)
    doc = {"command": " ".join(["benchmarks/hybrid_model_len.py", *sys.argv[1:]]),
           "device": jax.devices()[0].device_kind, "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "jax": jax.__version__,
           "model": model.source, "prompts": args.prompts, "batch_size": 1, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "rows": {name: row[name] for name in options}}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print({name: (round(row[name]["speedup"], 3), round(row[name]["mean_accepted_length"], 3)) for name in options},
          file=sys.stderr)


if __name__ == "__main__":
    main()
