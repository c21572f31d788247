"""How often an n-gram draft is accepted, by the length of the match it was looked up from and by slot: the table a
verify budget and a hybrid's choice of source read (`NGRAM_ACCEPTANCE` in specformer_jax/defaults.py).

    .venv/bin/python benchmarks/ngram_acceptance.py --out benchmarks/results/ngram_acceptance_dev.json

Teacher-forced on development prompts, never the benchmark ones: the target decodes each prompt greedily (plain
decoding), then at every point of its answer the lookup (decoding/drafts/ngram.py, `lookup`) drafts from the prompt
and the answer so far, exactly as a decoding row would. A greedy round accepts a draft when it and every draft
before it equal the target's next tokens, so slot j counts, among the points whose slots 1..j-1 were all equal, how
many had slot j equal too: the chance of slot j given the chain before it, which is what the product along a row
needs (as the drafter's calibration, modeling/calibration.py). Match length 0 is a row with no match.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.ngram import MAX_NGRAM_DRAFTS, TokenHistory, lookup
from specformer_jax.decoding.encode import encode_prompts, read_prompts_file
from specformer_jax.files import write_json

DEV_PROMPTS = ("history/prompts/heldout-chat.jsonl", "benchmarks/ngram/editing-dev.jsonl",
               "benchmarks/ngram/editing-dev-2.jsonl")


def count_matches(seq: list[int], prompt_len: int, max_n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(reached, accepted), int64[max_n + 1, k] each, over every point of one answer (seq: prompt then answer)."""
    points = range(prompt_len + 1, len(seq))  # the row has emitted seq[:p]; the target reads seq[p - 1] next
    S = len(seq)
    tokens = np.zeros((len(points), S), np.int32)
    for r, p in enumerate(points):
        tokens[r, : p - 1] = seq[1:p]
    history = TokenHistory(jnp.asarray(tokens), jnp.asarray([p - 1 for p in points], jnp.int32))
    drafts, n = (np.asarray(x) for x in lookup(history, k, max_n, 1))
    reached, accepted = np.zeros((max_n + 1, k), np.int64), np.zeros((max_n + 1, k), np.int64)
    for r, p in enumerate(points):
        for j in range(min(k, S - p)):
            reached[n[r], j] += 1
            if drafts[r, j] != seq[p + j]:
                break
            accepted[n[r], j] += 1
    return reached, accepted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--prompts", default=",".join(DEV_PROMPTS), help="comma-separated JSONL prompt files")
    ap.add_argument("--max-n", type=int, default=4, help="the longest suffix the lookup tries (NgramDrafts.max_n)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, k = load_target("default"), MAX_NGRAM_DRAFTS
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "max_n": args.max_n, "max_new_tokens": args.max_new_tokens, "sets": {}}
    total = np.zeros((2, args.max_n + 1, k), np.int64)
    for path in args.prompts.split(","):
        prompts = read_prompts_file(path)
        ids = encode_prompts(model, prompts)
        answers = generate(model, prompts, drafter="none", batch_size=8, max_new_tokens=args.max_new_tokens).token_ids
        counts = sum(np.stack(count_matches(p + a, len(p), args.max_n, k)) for p, a in zip(ids, answers))
        total += counts
        doc["sets"][path] = _table(counts)
        print(f"{path}: {len(prompts)} prompts, {int(counts[0, :, 0].sum())} points", file=sys.stderr)
    doc["all"] = _table(total)
    write_json(args.out, doc)
    for n, row in enumerate(doc["all"]["acceptance"]):
        rates = " ".join("-" if a is None else f"{a:.2f}" for a in row[:8])
        print(f"match {n}: {doc['all']['points'][n]:5d} points, slots 1-8 {rates}", file=sys.stderr)


def _table(counts: np.ndarray) -> dict:
    """Acceptance of slot j given slots before it, per match length, with the counts behind it (a slot never
    reached: null) and the expected drafts accepted at 4 and 7 drafts."""
    reached, accepted = counts
    rate = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
    chain = np.cumprod(np.nan_to_num(rate), axis=1)
    return {"points": reached[:, 0].tolist(), "reached": reached.tolist(), "accepted": accepted.tolist(),
            "acceptance": [[None if np.isnan(x) else round(float(x), 4) for x in row] for row in rate],
            "expected_accepted": {str(w): chain[:, :w].sum(1).round(3).tolist() for w in (4, 7)}}


if __name__ == "__main__":
    main()
