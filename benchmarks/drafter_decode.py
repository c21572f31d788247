"""Decoding speed with different drafters side by side in one run: plain decoding and speculative decoding with each
drafter at each draft length, on the same prompts, for each batch size.

    .venv/bin/python benchmarks/drafter_decode.py --drafters default,runs/v4-dv8192 --out benchmarks/results/x.json
    .venv/bin/python benchmarks/drafter_decode.py --drafters default@2,ngram@6,default+ngram@4 \
        --prompts editing --out ...

A drafter is any `--drafter` value (a directory, "default", "ngram", "default+ngram"); "NAME@k" runs it at k only
("NAME@default": at its default draft length for each batch size), a bare name at every `--draft-lens`.
`--prompts`: a prompt set (chat, code, editing) or a JSONL file.

`specformer bench` compares one drafter with plain decoding; comparing two drafters across two such runs mixes in
the machine's drift between them. Here every side runs once untimed (compiling every shape), then `--repeats`
times in alternating order (AB.. then ..BA), and each ratio is the median over repeats of the two sides' tokens/s
taken back to back (speedup: over plain decoding; vs_first_drafter: over the first drafter at the same k). Greedy,
so every speculative side must give the plain tokens: the script checks it.
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
import numpy as np

from specformer_jax.assets import prompt_set
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.kinds import specformer_part
from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.decoding.names import read_drafter


def sides(drafters: dict, draft_lens: list[int]) -> dict:
    """name -> generate options: "plain", then "DRAFTER@k" for each drafter and draft length (its own k when its name
    carries one)."""
    out = {"plain": {}}
    for k in draft_lens:
        out |= {f"{name}@{k}": {"drafter": d, "draft_len": k} for name, d in drafters.items() if "@" not in name}
    at = lambda name: None if name.endswith("@default") else int(name.rpartition("@")[2])
    out |= {name: {"drafter": d, "draft_len": at(name)} for name, d in drafters.items() if "@" in name}
    return out


def facts(drafter) -> dict:
    """Which weights a side drafted with (none for the n-gram lookup)."""
    loaded = specformer_part(drafter)
    return {"sha256": loaded.sha256, "draft_vocab": loaded.meta.get("draft_vocab")} if loaded else {}


def batch_row(model, prompts, batch: int, max_new: int, options: dict, repeats: int,
              prepare=lambda name: None) -> dict:
    """Every side's median tokens/s and accepted length at one batch size, and its speedup over plain decoding.
    options: side name -> generate options; prepare(name) is called before each of that side's runs (a measurement
    that sets what generate's options cannot)."""

    def run(name):
        prepare(name)
        return generate(model, prompts, batch_size=batch, max_new_tokens=max_new, **options[name])

    plain_ids = run("plain").token_ids  # also compiles plain decoding
    for name in options:
        if name != "plain" and run(name).token_ids != plain_ids:
            raise SystemExit(f"{name} at batch {batch}: speculative tokens differ from plain decoding")
    runs = {name: [] for name in options}
    for i in range(repeats):
        for name in (list(options) if i % 2 == 0 else list(options)[::-1]):
            runs[name].append(run(name).stats)
    tps = lambda name: [s["tokens_per_second"] for s in runs[name]]
    row = {"batch_size": batch, "num_prompts": len(prompts)}
    for name in options:
        last = runs[name][-1]
        row[name] = {"tokens_per_second": statistics.median(tps(name)), "tokens_per_second_runs": tps(name),
                     "mean_accepted_length": last.get("mean_accepted_length", 1.0),
                     "acceptance_rate_per_slot": last.get("acceptance_rate_per_slot"),
                     "draft_len": last.get("draft_len", 0)}
        if "by_source" in last:
            row[name]["by_source"] = {src: {key: by[key] for key in ("share_of_rounds", "mean_accepted_length")}
                                      for src, by in last["by_source"].items()}
        row[name]["speedup"] = statistics.median(b / a for a, b in zip(tps("plain"), tps(name)))
    for name in list(options)[1:]:  # each drafter against the first one at the same k, paired by repeat
        first = next(n for n in options if n.endswith(name[name.rfind("@"):]))
        if first != name:
            row[name]["vs_first_drafter"] = statistics.median(b / a for a, b in zip(tps(first), tps(name)))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default="default")
    ap.add_argument("--drafters", required=True, help="comma-separated drafter strings (as --drafter; NAME@k: at k)")
    ap.add_argument("--draft-lens", default="1,4")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompts", default="chat", help="a prompt set (chat, code, editing) or a JSONL file")
    ap.add_argument("--num-prompts", default="4,16", help="prompts used at each batch size (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = args.drafters.split(",")
    if len(set(names)) != len(names):
        raise SystemExit("--drafters: each drafter once")
    read = {name: read_drafter(name.partition("@")[0]) for name in names}  # a bad string fails before the model loads
    model = load_target(args.model)
    drafters = {name: drafter.load(model) for name, drafter in read.items()}
    options = sides(drafters, [int(k) for k in args.draft_lens.split(",")])
    prompts = read_prompts_file(prompt_set(args.prompts))
    rows = []
    batches, counts = args.batch_sizes.split(","), args.num_prompts.split(",")
    if len(batches) != len(counts):
        raise SystemExit("--num-prompts: one count per batch size")
    for batch, n in zip(map(int, batches), map(int, counts)):
        rows.append(batch_row(model, prompts[:n], batch, args.max_new_tokens, options, args.repeats))
        print(json.dumps({k: (v["speedup"] if isinstance(v, dict) else v) for k, v in rows[-1].items()}),
              file=sys.stderr)
    dev = jax.devices()[0]
    result = {"command": " ".join(sys.argv), "device": dev.device_kind, "platform": dev.platform,
              "cpu_count": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
              "numpy": np.__version__, "model": model.source, "dtype": model.cfg.dtype,
              "prompts": args.prompts, "drafters": {name: facts(d) for name, d in drafters.items()},
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
