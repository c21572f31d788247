"""Throughput plot of a bench result: tokens/s of AR and speculative decoding per batch size, speedup on top."""

from __future__ import annotations

from pathlib import Path

from specformer_jax.files import save_figure


def plot_bench(result: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    bs = [r["batch_size"] for r in rows]
    x = range(len(bs))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    ax.bar([i - width / 2 for i in x], [r["ar"]["tokens_per_second"] for r in rows], width, label="plain (AR)")
    if all("spec" in r for r in rows):
        spec = [r["spec"]["tokens_per_second"] for r in rows]
        ax.bar([i + width / 2 for i in x], spec, width, label=f"speculative (k={result['draft_len']})")
        for i, r in zip(x, rows):  # k = 0 (auto chose plain decoding) has no accepted length: 1 token per step
            ax.annotate(f"{r['speedup']:.2f}x, k={r['spec'].get('draft_len', '?')}\n"
                        f"AL {r['spec'].get('mean_accepted_length', 1.0):.2f}",
                        (i + width / 2, r["spec"]["tokens_per_second"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [str(b) for b in bs])
    ax.set(xlabel="batch size", ylabel="tokens/s",
           title=f"{result.get('model', '')} on {result['device']} ({result['dtype']})")
    ax.legend(loc="upper left")
    fig.tight_layout()
    save_figure(fig, out_png)
