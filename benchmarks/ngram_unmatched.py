"""What a round should do for an n-gram row with no match: verify nothing (the engine's choice: when no live row has a
match the round is a plain step, `NgramDrafts.widths`) or verify its k placeholder drafts, which are then rejected.
Both sides decode the same prompts in one run (drafter_decode.batch_row: alternating repeats, tokens checked
against plain decoding), at each batch size.

    .venv/bin/python benchmarks/ngram_unmatched.py --out benchmarks/results/ngram_unmatched_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import jax
from flax import struct

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_decode import batch_row  # noqa: E402

from specformer_jax.assets import prompt_set  # noqa: E402
from specformer_jax.checkpoints.loader import load_target  # noqa: E402
from specformer_jax.decoding.drafts.ngram import NgramDrafts  # noqa: E402
from specformer_jax.decoding.encode import read_prompts_file  # noqa: E402


@struct.dataclass
class VerifyUnmatched(NgramDrafts):
    """The alternative: every round verifies k drafts, a row without a match its placeholders."""

    def widths(self, plan):
        return plan.draft_len, plan.draft_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--prompts", default="benchmarks/ngram/editing-dev.jsonl", help="a prompt set or JSONL file")
    ap.add_argument("--batch-sizes", default="1,2")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    prompts = read_prompts_file(prompt_set(args.prompts))
    k = args.draft_len
    options = {"plain": {}, f"no drafts@{k}": {"drafter": NgramDrafts(), "draft_len": k},
               f"rejected drafts@{k}": {"drafter": VerifyUnmatched(), "draft_len": k}}
    rows = [batch_row(model, prompts, int(b), args.max_new_tokens, options, args.repeats)
            for b in args.batch_sizes.split(",")]
    dev = jax.devices()[0]
    result = {"command": " ".join(sys.argv), "device": dev.device_kind, "cpu_count": os.cpu_count(),
              "python": platform.python_version(), "jax": jax.__version__, "model": model.source,
              "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(row["batch_size"], {n: round(row[n]["speedup"], 3) for n in options}, file=sys.stderr)


if __name__ == "__main__":
    main()
