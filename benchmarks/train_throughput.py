"""Drafter training speed on this machine: answer tokens a second (and an hour) of `specformer train` with the live
target and with a state cache (`specformer cache-states`), each with the whole vocabulary and with a draft vocabulary.

Each side is a short run of the same recipe on the same data (same batches in the same order); the first logged
interval (compilation) is dropped and the median of the others kept. Ratios are against the live target with the
whole vocabulary, which is how every drafter was trained before the cache.

  .venv/bin/python benchmarks/train_throughput.py --data history/data/data-cpu-2000 \\
      --states runs/states-cpu-2000 --out benchmarks/results/train_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import jax

from specformer_jax.training.train_config import load_train_config
from specformer_jax.training.trainer import train

SIDES = {"live": {}, "live + draft vocab": {"draft_vocab_size": 8192}, "cached": {"states": True},
         "cached + draft vocab": {"states": True, "draft_vocab_size": 8192}}


def one_side(args, extra: dict, out: Path) -> dict:
    settings = [f"data={args.data}", f"out={out}", f"steps={args.steps}", f"log_every={args.log_every}",
                f"batch_size={args.batch_size}", f"seq_len={args.seq_len}", "eval_batches=0",
                f"save_every={args.steps}", "eval_data=null"]
    settings += [f"{k}={args.states if v is True else v}" for k, v in extra.items()]
    train(load_train_config(args.config, settings), progress=False)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in logged if m["split"] == "train"][1:]  # the first interval compiles
    tps = statistics.median(m["answer_tokens_per_second"] for m in timed)
    return {"settings": settings, "answer_tokens_per_second": tps, "answer_tokens_per_hour": 3600 * tps,
            "seconds_per_step": statistics.median(m["seconds_per_step"] for m in timed),
            "intervals": [m["answer_tokens_per_second"] for m in timed]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", default="configs/drafter-smollm2.yaml", help="the recipe (v4's by default)")
    p.add_argument("--data", required=True)
    p.add_argument("--states", required=True, help="a cache-states directory of --data")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--log-every", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SIDES.items():
            rows[name] = one_side(args, extra, Path(tmp) / name.replace(" + ", "-"))
            print(f"{name}: {rows[name]['answer_tokens_per_second']:.0f} answer tokens/s, "
                  f"{rows[name]['seconds_per_step']:.2f} s a step", file=sys.stderr)
    base = rows["live"]["answer_tokens_per_second"]
    for r in rows.values():
        r["ratio_to_live"] = r["answer_tokens_per_second"] / base
    dev = jax.devices()[0]
    doc = {"command": " ".join(sys.argv), "device": dev.device_kind, "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "jax": jax.__version__, "config": args.config, "data": args.data,
           "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
