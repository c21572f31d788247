"""Plots of a bench result: tokens/s of AR and speculative decoding per batch size with the speedup on top, or for
`bench --set-acceptance` the speedup per batch size, one line per rate."""

from __future__ import annotations

from pathlib import Path

from specformer_jax.files import save_figure


def plot_bench(result: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result.get("set_acceptance"):
        return _plot_rates(result, out_png, plt)
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


def _plot_rates(result: dict, out_png: Path, plt) -> None:
    """Speedup over plain decoding per batch size, a line per set acceptance rate, each point's measured AL."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for rate in result["set_acceptance"]["rates"]:
        rows = [r for r in result["results"] if r.get("set_acceptance") == rate and "speedup" in r]
        bs = [r["batch_size"] for r in rows]
        ax.plot(bs, [r["speedup"] for r in rows], "o-", label=f"a = {rate:g}")
        for b, r in zip(bs, rows):
            ax.annotate(f"AL {r['spec'].get('mean_accepted_length', 1.0):.2f}", (b, r["speedup"]), fontsize=7,
                        textcoords="offset points", xytext=(0, 5), ha="center")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup over plain decoding",
           title=f"{result.get('model', '')} on {result['device']} ({result['dtype']}), k = {result['draft_len']}, "
                 "set acceptance")
    ax.legend(title="acceptance per draft")
    fig.tight_layout()
    save_figure(fig, out_png)
