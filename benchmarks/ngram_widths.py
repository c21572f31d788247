"""What a round costs by the number of drafts it verifies, with no drafter: n-gram rounds whose drafts are all
rejected (set acceptance 0), against plain steps, in one run with alternating repeats. The widths that cost least
per draft are the n-gram's and hybrid's default draft lengths on a CPU (decoding/drafters.py).

    .venv/bin/python benchmarks/ngram_widths.py --out benchmarks/results/ngram_widths_cpu.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ngram_unmatched import VerifyUnmatched  # noqa: E402

from specformer_jax.assets import PROMPT_SETS  # noqa: E402
from specformer_jax.checkpoints.loader import load_target  # noqa: E402
from specformer_jax.decoding.api import generate  # noqa: E402
from specformer_jax.decoding.encode import read_prompts_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--draft-lens", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model = load_target("default")
    prompts = read_prompts_file(PROMPT_SETS["chat"])[: args.num_prompts]
    sides = {"plain": {}} | {f"k={k}": dict(drafter=VerifyUnmatched(), draft_len=k, set_acceptance=0.0)
                             for k in map(int, args.draft_lens.split(","))}
    run = lambda kw: generate(model, prompts, max_new_tokens=64, batch_size=1, **kw).stats
    for kw in sides.values():
        run(kw)  # compiles
    ms = {name: [] for name in sides}
    for i in range(args.repeats):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            s = run(sides[name])
            ms[name].append(1000 * s["run_seconds"] / s["rounds_run"])
    step = statistics.median(ms["plain"])
    rows = {name: {"ms_per_round": statistics.median(v), "plain_steps": statistics.median(v) / step, "runs": v}
            for name, v in ms.items()}
    dev = jax.devices()[0]
    doc = {"command": " ".join(sys.argv), "device": dev.device_kind, "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "jax": jax.__version__, "model": model.source, "batch_size": 1,
           "max_new_tokens": 64, "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print({name: round(r["plain_steps"], 3) for name, r in rows.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
