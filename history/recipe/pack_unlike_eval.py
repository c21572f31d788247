"""Pack a finished distillation for training, leaving out the records whose prompt is like an evaluation prompt:
`pack_unlike_eval.py DISTILLED PROMPTS.jsonl --out PACKED [--ratio 0.8]`.

`new_prompts.py` drops only prompts seen before, word for word. A self-written request can still be an evaluation
prompt in other words ("Write a Python function that will determine whether or not a string is a palindrome."), and
the target's answer to it then nearly repeats the answer the drafter is scored on. Every record whose prompt
(PROMPTS.jsonl, the file the run was distilled from, by the record's index) comes within `ratio` (difflib, case
aside) of a prompt of the benchmark, held-out chat, code or editing sets is left out, and named on stdout.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.errors import SpecformerError
from specformer_jax.training.data.dataset import read_distilled, read_manifest
from specformer_jax.training.data.packed import pack_records

EVAL_SETS = (*PROMPT_SETS.values(), Path(__file__).parents[1] / "prompts" / "heldout-chat.jsonl")


def nearest(prompt: str, evals: dict[str, str]) -> tuple[float, str]:
    """The evaluation prompt most like `prompt` and how alike they are (difflib ratio of the lower-cased texts);
    `evals` maps each evaluation prompt to its lower-cased text."""
    low = prompt.lower()
    return max((difflib.SequenceMatcher(None, low, e_low).ratio(), e) for e, e_low in evals.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("distilled", type=Path)
    ap.add_argument("prompts", type=Path, help="the prompts file the run was distilled from")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ratio", type=float, default=0.8)
    args = ap.parse_args()
    try:
        records, manifest = read_distilled(args.distilled, for_training=True), read_manifest(args.distilled)
        prompts = read_prompts_file(args.prompts)
        evals = {p: p.lower() for path in EVAL_SETS for p in read_prompts_file(path)}
        if len(prompts) != manifest["num_prompts"]:
            raise SpecformerError(f"{args.prompts} holds {len(prompts)} prompts; {args.distilled} was distilled from "
                                  f"{manifest['num_prompts']}")
        kept = []
        for rec in records:
            ratio, like = nearest(prompts[rec["index"]], evals)
            if ratio >= args.ratio:
                print(f"left out ({ratio:.2f}): {prompts[rec['index']]!r}, like {like!r}")
            else:
                kept.append(rec)
        written = pack_records(kept, {**manifest, "num_prompts": len(kept)}, args.out)
    except SpecformerError as e:
        print(f"pack_unlike_eval.py: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"packed {written['records']} of {len(records)} records, {written['tokens']} tokens, in {written['shards']} "
          f"shards")


if __name__ == "__main__":
    main()
