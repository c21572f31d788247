"""The v5-on-the-CPU table, numbers and curves from its runs: `table.py RUNS --out DIR` reads every arm under RUNS
(v4: the shipped drafter's evals only; an arm without metrics.jsonl: a drafter made otherwise, e.g. by
`specformer average-drafters`, and its evals) and writes arms.json, table.md, curves.png and each trained arm's
metrics-ARM.jsonl into DIR (run.sh calls it)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SETS = ("bench", "heldout")


def arm_numbers(run: Path) -> dict:
    evals = {s: {int(p.stem.split("_k")[1]): json.loads(p.read_text()) for p in run.glob(f"eval_{s}_k*.json")}
             for s in SETS}
    n = {"eval": evals}
    if (run / "metrics.jsonl").is_file():
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        n["curve"] = [(m["step"], m["decoding_accepted_length"]) for m in lines if m["split"] == "eval"]
        n["drafter"] = json.loads((run / "drafter" / "drafter.json").read_text())["drafter"]
    return n


def table(numbers: dict) -> str:
    out = []
    for s in SETS:
        base = numbers["v4"]["eval"][s].get(4, {}).get("decoding_accepted_length")
        out.append(f"\n{'Benchmark prompts (16)' if s == 'bench' else 'Second held-out set (40)'}:\n\n"
                   "| arm | decoding AL k = 1 | 2 | 3 | 4 | vs v4 at k = 4 | slot 0 accepted, teacher-forced (k = 4) "
                   "| teacher-forced AL (k = 4) |\n|---|---|---|---|---|---|---|---|")
        for arm, n in numbers.items():
            e = n["eval"][s]
            if 4 not in e:
                continue
            dal = [f"{e[k]['decoding_accepted_length']:.3f}" if k in e else "" for k in (1, 2, 3, 4)]
            delta = e[4]["decoding_accepted_length"] - base
            first = e[4]["acceptance_rate_per_slot"][0]
            out.append(f"| {arm} | {' | '.join(dal)} | {delta:+.3f} | {first:.3f} | "
                       f"{e[4]['expected_accepted_length']:.3f} |")
    return "\n".join(out).lstrip() + "\n"


def plot(numbers: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, n in numbers.items():
        if n.get("curve"):
            ax.plot([c[0] for c in n["curve"]], [c[1] for c in n["curve"]], marker="o", label=arm)
    if 4 in numbers["v4"]["eval"]["bench"]:
        ax.axhline(numbers["v4"]["eval"]["bench"][4]["decoding_accepted_length"], color="grey", ls="--", label="v4")
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("decoding accepted length (k = 4)")
    ax.set_title("Fine-tuned on the CPU: periodic eval, benchmark prompts", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("runs", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    arms = ["v4"] + sorted(p.parent.parent.name for p in args.runs.glob("*/drafter/drafter.json"))
    numbers = {arm: arm_numbers(args.runs / arm) for arm in arms}
    args.out.mkdir(parents=True, exist_ok=True)  # a new session's folder
    for arm in arms[1:]:
        if (args.runs / arm / "metrics.jsonl").is_file():  # an arm that averages drafters has no run of its own
            shutil.copy(args.runs / arm / "metrics.jsonl", args.out / f"metrics-{arm}.jsonl")
    (args.out / "arms.json").write_text(json.dumps(numbers, indent=1) + "\n")
    text = table(numbers)
    (args.out / "table.md").write_text(text)
    plot(numbers, args.out / "curves.png")
    print(text)


if __name__ == "__main__":
    main()
