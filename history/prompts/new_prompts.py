"""Keep the sampled prompts no earlier drafter saw: `new_prompts.py SAMPLED.jsonl... --out NEW.jsonl [--num N]` drops
every prompt (case and spacing aside) among the self-written training prompts before it (v2's, self-prompts-2 to -10)
and the held-out chat prompts, and repeats; the benchmark prompts never get this far (sample-prompts leaves them
out)."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.errors import SpecformerError
from specformer_jax.training.data.prompts import normalise_prompt

HERE = Path(__file__).parent
# self-prompts-SET.jsonl.gz, named one by one: a glob would count a new set's own prompts as seen before this filters
SETS = ("2", "3", "4-code", "4-general", "5-code", "5-questions", "6-explain", "6-write", "7-explain", "7-write",
        "8-explain", "8-write", "9-form", "9-tools", "10-code", "10-tools", "11-code", "11-tools")
SEEN = (HERE / "self-prompts-v2.jsonl.gz", HERE / "heldout-chat.jsonl",
        *(HERE / f"self-prompts-{name}.jsonl.gz" for name in SETS))


def prompts(path: Path) -> list[str]:
    if path.suffix != ".gz":
        return read_prompts_file(path)
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("sampled", type=Path, nargs="+", help="sampled prompt files, kept in this order")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num", type=int, default=None, help="keep at most this many")
    args = ap.parse_args()
    seen = {normalise_prompt(p) for path in SEEN for p in prompts(path)}
    try:
        sampled = [p for path in args.sampled for p in prompts(path)]
    except SpecformerError as e:
        print(f"new_prompts.py: {e}", file=sys.stderr)
        sys.exit(2)
    kept = []
    for p in sampled:
        key = normalise_prompt(p)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    kept = kept[: args.num]
    if not kept:  # an empty prompts file would only fail later, in distill
        print(f"new_prompts.py: none of the {len(sampled)} sampled prompts is new; nothing written", file=sys.stderr)
        sys.exit(2)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in kept))
    print(f"kept {len(kept)} of {len(sampled)}")


if __name__ == "__main__":
    main()
