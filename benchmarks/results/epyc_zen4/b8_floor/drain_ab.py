"""The drain prototypes of drain_prototypes.json, side by side with plain decoding and the defaults: run with the
prototype applied (`git apply drain_rounds_prototype.patch` at 5b1df46), from the repository's root:

    python benchmarks/results/epyc_zen4/b8_floor/drain_ab.py BATCH PROMPTS REPEATS MODE

MODE: "tables" (each chunk at the defaults of its live rows), "wide" (4 drafts a row with 3 or fewer rows live,
SPEC_WIDE_AT overrides 3; the pool drafts only the slots a chunk verifies) or "b16" (tables, the pool speculative
at batch 16). Every side's tokens are checked against plain decoding's.
"""

import os
import statistics
import sys

from specformer_jax.assets import PROMPT_SETS
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.training.data.prompts import read_prompts_file

B, prompts, reps, mode = int(sys.argv[1]), read_prompts_file(PROMPT_SETS[sys.argv[2]]), int(sys.argv[3]), sys.argv[4]
model = load_target("default")
drafter = resolve_drafter("default", model)
pinned = dict(draft_len=4 if mode == "wide" else 2, verify_budget=B)
env = {"SPEC_DRAIN": "wide" if mode == "wide" else "tables", "SPEC_NARROW": "1" if mode == "wide" else ""}
sides = {"plain": (None, {}, {}), "defaults": (drafter, {}, {}), "prototype": (drafter, pinned, env)}
if mode == "b16":
    del sides["defaults"]


def run(side):
    d, kw, variables = sides[side]
    for name in ("SPEC_DRAIN", "SPEC_NARROW"):
        os.environ[name] = variables.get(name, "")
    return generate(model, prompts, drafter=d, batch_size=B, max_new_tokens=64, progress=False, **kw)


plain = run("plain").token_ids
for side in list(sides)[1:]:
    r = run(side)
    assert r.token_ids == plain, side
    print(side, "compile", round(r.stats["compile_seconds"], 1), "rounds", r.stats["rounds_run"],
          "accepted length", round(r.stats.get("mean_accepted_length", 1.0), 3))
tps = {side: [] for side in sides}
for i in range(reps):
    for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
        tps[side].append(run(side).stats["tokens_per_second"])
for side in list(sides)[1:]:
    ratios = [b / a for a, b in zip(tps["plain"], tps[side])]
    print(f"{side}: median {statistics.median(ratios):.3f}x plain, pairs {[round(x, 3) for x in ratios]}")
