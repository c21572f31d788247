"""`specformer report`: bench result files from different devices side by side, each held against its roofline.

For every file and batch size: measured plain and speculative tokens/s, the roofline bound of each (bench/roofline.py,
at the benchmark's mid-decode context length and the measured mean accepted length), the fraction of the bound
reached, and measured vs estimated speedup. The plot draws speedup per batch size, one line per device (measured
solid, roofline dashed).
"""

from __future__ import annotations

import json
from pathlib import Path

from specformer_jax.bench.roofline import device_limits, round_seconds, step_seconds
from specformer_jax.errors import SpecformerError
from specformer_jax.files import save_figure


def load_results(paths: list[Path]) -> list[dict]:
    out = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except OSError as e:
            raise SpecformerError(f"cannot read {p}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise SpecformerError(f"{p} is not valid JSON ({e.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise SpecformerError(f"{p} is not a `specformer bench` result file")
        if "model_facts" not in doc:
            raise SpecformerError(f"{p} records no model facts (an older bench file): run `specformer bench` again")
        out.append({**doc, "_path": str(p)})
    return out


def estimate(doc: dict) -> list[dict]:
    """Per batch size: measured numbers and their roofline counterparts."""
    try:
        bw, peak, source = device_limits(doc)
    except ValueError as e:
        raise SpecformerError(f"{doc['_path']}: {e}") from None
    facts = doc["model_facts"]
    context = doc["mean_prompt_tokens"] + doc["max_new_tokens"] / 2
    rows = []
    for r in doc["results"]:
        B = r["batch_size"]
        t_step = step_seconds(facts, B, context, bw, peak)
        row = {"batch_size": B, "ar": r["ar"]["tokens_per_second"], "ar_roofline": B / t_step, "limits": source}
        spec = r.get("spec")
        if spec and spec.get("draft_len", doc.get("draft_len", 0)) and "drafter_weight_bytes" in facts:
            k = spec.get("draft_len", doc["draft_len"])
            al = spec.get("mean_accepted_length", 1.0)
            t_round = round_seconds(facts, B, context, k, bw, peak)
            row.update({"k": k, "al": al, "spec": spec["tokens_per_second"], "spec_roofline": B * al / t_round,
                        "speedup": r["speedup"], "speedup_roofline": al * t_step / t_round,
                        "equivalence": r.get("output_equivalence")})
        rows.append(row)
    return rows


def _label(doc: dict) -> str:
    return f"{doc['device']} ({doc['dtype']})"


def render_markdown(docs: list[dict]) -> str:
    lines = ["# specformer benchmark report", "",
             "Roofline: t = max(bytes / bandwidth, FLOPs / peak) per plain step and per speculative round "
             "(`specformer_jax/bench/roofline.py`); speculative estimates use the measured mean accepted length (AL). "
             "`% roof` = measured / roofline tokens/s.", ""]
    for doc in docs:
        bw, peak, source = device_limits(doc)
        v = doc.get("versions", {})
        lines += [f"## {_label(doc)}", "",
                  f"`{doc.get('command', '?')}` → `{doc['_path']}`  ",
                  f"model {doc.get('model', '?')}, drafter {doc.get('drafter', '?')}, {doc['num_prompts']} prompts, "
                  f"{doc['max_new_tokens']} new tokens, jax {v.get('jax', '?')}; limits ({source}): "
                  f"{bw / 1e9:.0f} GB/s, {peak / 1e12:.2f} TFLOP/s", "",
                  "| batch | AR tok/s | AR roofline | % roof | k | AL | spec tok/s | spec roofline | % roof | speedup "
                  "| roofline speedup | same output |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in estimate(doc):
            cells = [r["batch_size"], f"{r['ar']:.1f}", f"{r['ar_roofline']:.1f}", f"{100 * r['ar'] / r['ar_roofline']:.0f}%"]
            if "spec" in r:
                eq = "" if r["equivalence"] is None else f"{100 * r['equivalence']:.0f}%"
                cells += [r["k"], f"{r['al']:.2f}", f"{r['spec']:.1f}", f"{r['spec_roofline']:.1f}",
                          f"{100 * r['spec'] / r['spec_roofline']:.0f}%", f"{r['speedup']:.2f}x",
                          f"{r['speedup_roofline']:.2f}x", eq]
            else:
                cells += ["0"] + [""] * 7
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_report(docs: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, doc in enumerate(docs):
        rows = [r for r in estimate(doc) if "spec" in r]
        if not rows:
            continue
        bs = [r["batch_size"] for r in rows]
        ax.plot(bs, [r["speedup"] for r in rows], "o-", color=f"C{i}", label=f"{_label(doc)} measured")
        ax.plot(bs, [r["speedup_roofline"] for r in rows], "--", color=f"C{i}", label=f"{_label(doc)} roofline")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup over plain decoding", title="SpecFormer speculative decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out_png)
