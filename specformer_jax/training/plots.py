"""Training curves from metrics.jsonl: loss and per-slot accuracy over steps, train and eval."""

from __future__ import annotations

import json
from pathlib import Path

from specformer_jax.files import save_figure


def plot_training(metrics_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
    train = [m for m in lines if m["split"] == "train"]
    evals = [m for m in lines if m["split"] == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 5))
    ax_loss.plot([m["step"] for m in train], [m["loss"] for m in train], label="train", alpha=0.7)
    if evals:
        ax_loss.plot([m["step"] for m in evals], [m["loss"] for m in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="mean per-slot cross-entropy", title="drafter loss")
    source = evals or train
    for i in range(len(source[0]["accuracy_per_slot"])):
        ax_acc.plot([m["step"] for m in source], [m["accuracy_per_slot"][i] for m in source], "o-" if evals else "-",
                    label=f"slot {i} (token t+{i + 2})")
    if evals:
        ax2 = ax_acc.twinx()
        ax2.plot([m["step"] for m in evals], [m["expected_accepted_length"] for m in evals], "k--",
                 label="expected accepted length, teacher-forced (right axis)")
        replayed = [m for m in evals if "decoding_accepted_length" in m]
        if replayed:
            ax2.plot([m["step"] for m in replayed], [m["decoding_accepted_length"] for m in replayed], "k:",
                     label="decoding accepted length (right axis)")
        ax2.set_ylabel("accepted length (tokens per round)")
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy (left axis)",
               title=f"{'eval' if evals else 'train'} accuracy per slot")
    handles = [h for ax in fig.axes[1:] for h in ax.get_legend_handles_labels()[0]]  # below the panel, off the data
    ax_acc.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax_loss.legend(loc="upper right")
    fig.tight_layout()
    save_figure(fig, out_png)
