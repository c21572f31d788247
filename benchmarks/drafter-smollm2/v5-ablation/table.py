"""The v5 ablation's table, numbers and curves from its runs: `table.py RUNS --arms v4 ... --out DIR` writes
ablation.json, table.md, curves.png and each arm's metrics-ARM.jsonl into DIR (run.sh calls it)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CHANGE = {"v4": "v4's recipe", "next_token": "+ next token at the slots",
          "context_token": "+ next token at the context", "draft_vocab": "+ draft vocabulary", "k8": "+ eight slots"}


def arm_numbers(run: Path) -> dict:
    evals = {int(p.stem.removeprefix("eval_k")): json.loads(p.read_text()) for p in run.glob("eval_k*.json")}
    meta = json.loads((run / "drafter" / "drafter.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    curve = [(m["step"], m["decoding_accepted_length"], m["expected_accepted_length"]) for m in lines
             if m["split"] == "eval"]
    return {"drafter": meta["drafter"], "draft_vocab": meta.get("draft_vocab"), "eval": evals, "curve": curve,
            "final_train_loss": next((m["loss"] for m in reversed(lines) if m["split"] == "train"), None)}


def table(numbers: dict, k: int = 4) -> str:
    head = ("| arm | change | accuracy per slot | teacher-forced AL (k = 4) | decoding AL (k = 4) | vs v4 "
            "| coverage |\n|---|---|---|---|---|---|---|\n")
    base = numbers.get("v4", {}).get("eval", {}).get(k, {}).get("decoding_accepted_length")
    rows = []
    for arm, n in numbers.items():
        e = n["eval"].get(k) or {}
        acc = " ".join(f"{a:.3f}" for a in (n["eval"].get(max(n["eval"]), {}).get("accuracy_per_slot") or []))
        dal = e.get("decoding_accepted_length")
        delta = f"{dal - base:+.3f}" if dal is not None and base is not None else ""
        cov = e.get("draft_vocab_coverage")
        rows.append(f"| {arm} | {CHANGE.get(arm, arm)} | {acc} | {e.get('expected_accepted_length', '')} | "
                    f"{dal if dal is not None else ''} | {delta} | {'' if cov is None else f'{cov:.1%}'} |")
    return head + "\n".join(rows) + "\n"


def k_table(n: dict) -> str:
    ks = sorted(n["eval"])
    return ("| k | " + " | ".join(map(str, ks)) + " |\n|---|" + "---|" * len(ks) + "\n"
            + "| teacher-forced AL | " + " | ".join(f"{n['eval'][k]['expected_accepted_length']:.3f}" for k in ks)
            + " |\n| decoding AL | " + " | ".join(f"{n['eval'][k]['decoding_accepted_length']:.3f}" for k in ks)
            + " |\n")


def plot(numbers: dict, path: Path) -> None:
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for arm, n in numbers.items():
        steps = [c[0] for c in n["curve"]]
        ax[0].plot(steps, [c[1] for c in n["curve"]], marker="o", label=arm)
        ax[1].plot(steps, [c[2] for c in n["curve"]], marker="o", label=arm)
    for a, what in zip(ax, ("decoding", "teacher-forced")):
        a.set_xlabel("step")
        a.set_ylabel(f"{what} accepted length (K slots)")
        a.grid(alpha=0.3)
    ax[0].legend()
    fig.suptitle("v5 ablation: periodic eval on the benchmark prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--arms", nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    numbers = {arm: arm_numbers(args.runs / arm) for arm in args.arms if (args.runs / arm / "drafter").is_dir()}
    for arm in numbers:
        shutil.copy(args.runs / arm / "metrics.jsonl", args.out / f"metrics-{arm}.jsonl")
    (args.out / "ablation.json").write_text(json.dumps(numbers, indent=1) + "\n")
    text = table(numbers)
    if "k8" in numbers:
        text += "\nEight slots, scored at every k:\n\n" + k_table(numbers["k8"])
    (args.out / "table.md").write_text(text)
    plot(numbers, args.out / "curves.png")
    print(text)


if __name__ == "__main__":
    main()
