"""`specformer bench`: for each batch size, plain and speculative decoding of the same prompts in one process.

Compilation is excluded (each shape is compiled by a warm-up call first). Reports tokens/s of both, speedup, mean
accepted length, per-slot acceptance, output equivalence (greedy: fraction of identical rows), device and versions.
"""

from __future__ import annotations

import os
import platform
import sys

import flax
import jax

from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.decoding.api import Prompt, generate

KEEP = ("tokens_per_second", "run_seconds", "num_generated", "mean_accepted_length", "acceptance_rate_per_slot",
        "rounds")


def run_benchmark(model: LoadedTarget, drafter: LoadedDrafter | None, prompts: list[Prompt], *,
                  batch_sizes: list[int], draft_len: int | None, max_new_tokens: int, log=sys.stderr) -> dict:
    rows = []
    for bs in batch_sizes:
        row: dict = {"batch_size": bs}
        outputs = {}
        for name, d in (("ar", None), ("spec", drafter)):
            if name == "spec" and d is None:
                continue
            kw = dict(max_new_tokens=max_new_tokens, batch_size=bs, drafter=d, draft_len=draft_len)
            generate(model, prompts[:bs], **kw)  # compile every shape used below
            res = generate(model, prompts, **kw)
            row[name] = {k: res.stats[k] for k in KEEP if k in res.stats}
            outputs[name] = res.token_ids
        if "spec" in row:
            row["speedup"] = row["spec"]["tokens_per_second"] / row["ar"]["tokens_per_second"]
            row["output_equivalence"] = sum(a == b for a, b in zip(outputs["ar"], outputs["spec"])) / len(prompts)
        rows.append(row)
        if log:
            speed = f", speedup {row['speedup']:.2f}x, AL {row['spec']['mean_accepted_length']:.2f}" if "spec" in row else ""
            print(f"specformer bench: batch {bs}: AR {row['ar']['tokens_per_second']:.1f} tok/s{speed}", file=log)
    return {
        "draft_len": draft_len if draft_len is not None else (drafter.cfg.num_slots if drafter else 0),
        "dtype": model.cfg.dtype,
        "max_new_tokens": max_new_tokens,
        "num_prompts": len(prompts),
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": rows,
    }
