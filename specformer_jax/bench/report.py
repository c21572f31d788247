"""`specformer report`: bench result files from different devices side by side, each held against its roofline.

For every file and batch size: measured plain and speculative tokens/s, the roofline bound of each (bench/roofline.py,
at the benchmark's mid-decode context length and the measured mean accepted length), the fraction of the bound
reached, and measured vs estimated speedup; files of `bench --set-acceptance` have a row per batch size and rate.
For the same shapes, the roofline speedup on TPUs (TPU_ESTIMATES, published limits): estimates, labelled as such.
The plot draws speedup per batch size, one line per device and rate (measured solid, roofline dashed).
"""

from __future__ import annotations

import json
from pathlib import Path

from specformer_jax.bench.roofline import DEVICE_SPECS, device_limits, round_seconds, step_seconds
from specformer_jax.checks import NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, Kind
from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_json, save_figure

FACTS = ("target_weight_bytes", "kv_bytes_per_token", "target_matmul_flops_per_token",
         "attention_flops_per_token_per_context")
DRAFTER_FACTS = ("drafter_weight_bytes", "drafter_context_flops_per_token",
                 "drafter_attention_flops_per_token_per_context", "drafter_slot_flops_fixed",
                 "drafter_slot_flops_per_slot")
TPU_ESTIMATES = ("TPU v5e", "TPU v5p", "TPU v6e")
KERNELS_KEYS = {"impl", "chain", "num_kv_heads"}  # in `specformer bench-kernels` files, which have no "model"

TEXT = Kind("text", lambda v: isinstance(v, str), str)
OBJECT = Kind("an object", lambda v: isinstance(v, dict), dict)
FLAG = Kind("true or false", lambda v: isinstance(v, bool), bool)
_REQUIRED = object()


def _field(p, obj, where: str, key: str, kind: Kind = NON_NEGATIVE, default=_REQUIRED):
    """obj[key] if it is of the kind the report reads (or default when absent and one is given), else a one-line
    error naming the file and what in it is missing or wrong."""
    if not isinstance(obj, dict) or key not in obj:
        if default is not _REQUIRED:
            return default
        raise SpecformerError(f'{p}: not a complete specformer bench result ({where} lacks "{key}")')
    if not kind.ok(obj[key]):
        shown = json.dumps(obj[key])
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise SpecformerError(f'{p}: not a complete specformer bench result ({where} has "{key}": {shown}, not '
                              f'{kind.what})')
    return obj[key]


def _check(p, doc: dict) -> None:
    """Every field the report reads is there and of the right kind, so a damaged file fails in one line."""
    top = "the file"
    for key in ("device", "dtype"):
        _field(p, doc, top, key, TEXT)
    for key in ("num_prompts", "max_new_tokens", "mean_prompt_tokens"):
        _field(p, doc, top, key)
    _field(p, doc, top, "versions", OBJECT, default={})
    _field(p, doc, top, "complete", FLAG, default=True)
    if doc["device"] not in DEVICE_SPECS:  # no published limits: the bench's own measurement is used
        m = _field(p, doc, top, "device_measured", OBJECT)
        bw = "read_bandwidth_gb_per_s" if "read_bandwidth_gb_per_s" in m else "copy_bandwidth_gb_per_s"
        for key in (bw, "matmul_tflop_per_s"):
            _field(p, m, '"device_measured"', key, POSITIVE)
    facts = _field(p, doc, top, "model_facts", OBJECT)
    _field(p, facts, '"model_facts"', FACTS[0], POSITIVE)
    rows = doc["results"]
    want_spec = (doc.get("drafter", "none") not in ("none", None)  # bench --drafter none measures plain decoding only
                 or any(isinstance(r, dict) and "spec" in r for r in rows))
    for key in FACTS[1:] + (DRAFTER_FACTS if want_spec else ()):
        _field(p, facts, '"model_facts"', key)
    for i, r in enumerate(rows):
        where = f"batch {_field(p, r, f'result {i + 1}', 'batch_size', POSITIVE_INT)}"
        _field(p, _field(p, r, where, "ar", OBJECT), f'{where} "ar"', "tokens_per_second")
        if want_spec:
            _check_spec(p, doc, r, where)


def _check_spec(p, doc: dict, r: dict, where: str) -> None:
    """The speculative side of one batch size (nothing more to read when its draft length is 0)."""
    spec = _field(p, r, where, "spec", OBJECT)
    holder, at = (spec, f'{where} "spec"') if "draft_len" in spec else (doc, "the file")
    if _field(p, holder, at, "draft_len", NON_NEGATIVE_INT, default=0):
        _field(p, spec, f'{where} "spec"', "tokens_per_second")
        _field(p, spec, f'{where} "spec"', "mean_accepted_length", POSITIVE, default=1.0)
        _field(p, r, where, "speedup")
        if r.get("output_equivalence") is not None:
            _field(p, r, where, "output_equivalence")


def load_results(paths: list[Path]) -> list[dict]:
    """The bench result files, each checked for every field the report reads."""
    out = []
    for p in paths:
        doc = read_json(p, "result file")
        if isinstance(doc, dict) and "model" not in doc and KERNELS_KEYS & doc.keys():
            raise SpecformerError(f"{p} is a bench-kernels result; report reads specformer bench files")
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise SpecformerError(f"{p} is not a `specformer bench` result file")
        if any(isinstance(r, dict) and "parts_seconds" in r for r in doc["results"]):
            raise SpecformerError(f"{p} is a profile-round result; report reads specformer bench files")
        if "model_facts" not in doc:
            raise SpecformerError(f"{p} records no model facts (an older bench file): run `specformer bench` again")
        if not doc["results"]:
            raise SpecformerError(f'{p} records no batch sizes (its "results" list is empty)')
        _check(p, doc)
        out.append({**doc, "_path": str(p)})
    return out


def _context(doc: dict) -> float:
    """The mid-decode context length the roofline is taken at."""
    return doc["mean_prompt_tokens"] + doc["max_new_tokens"] / 2


def estimate(doc: dict) -> list[dict]:
    """Per batch size (and set acceptance rate): measured numbers and their roofline counterparts."""
    bw, peak, source = device_limits(doc)  # load_results checked that the file has what this reads
    facts, context = doc["model_facts"], _context(doc)
    rows = []
    for r in doc["results"]:
        B = r["batch_size"]
        t_step = step_seconds(facts, B, context, bw, peak)
        row = {"batch_size": B, "rate": r.get("set_acceptance"), "ar": r["ar"]["tokens_per_second"],
               "ar_roofline": B / t_step, "limits": source}
        spec = r.get("spec")
        if spec and spec.get("draft_len", doc.get("draft_len", 0)):  # load_results checked the drafter facts
            k = spec.get("draft_len", doc["draft_len"])
            al = spec.get("mean_accepted_length", 1.0)
            t_round = round_seconds(facts, B, context, k, bw, peak)
            row.update({"k": k, "al": al, "law_al": spec.get("law_accepted_length"),
                        "spec": spec["tokens_per_second"], "spec_roofline": B * al / t_round,
                        "speedup": r["speedup"], "speedup_roofline": al * t_step / t_round,
                        "equivalence": r.get("output_equivalence")})
        rows.append(row)
    return rows


def tpu_estimates(doc: dict) -> list[dict]:
    """The roofline speedup of the file's model, batch sizes, k and measured AL on each TPU of TPU_ESTIMATES, from
    published limits: what the same shapes would give there, estimated (no TPU ran)."""
    facts, context = doc["model_facts"], _context(doc)
    out = []
    for r in estimate(doc):
        if "spec" not in r:
            continue
        row = {key: r[key] for key in ("batch_size", "rate", "k", "al")}
        for device in TPU_ESTIMATES:
            bandwidth, bf16, f32 = DEVICE_SPECS[device]
            limits = (bandwidth * 1e9, (f32 if doc["dtype"] == "float32" else bf16) * 1e12)
            t_step = step_seconds(facts, r["batch_size"], context, *limits)
            row[device] = r["al"] * t_step / round_seconds(facts, r["batch_size"], context, r["k"], *limits)
        out.append(row)
    return out


def _key(r: dict) -> tuple:
    return r["batch_size"], r["rate"] if r["rate"] is not None else -1.0


def _batch(r: dict) -> str:
    return str(r["batch_size"]) + ("" if r["rate"] is None else f", a = {r['rate']:g}")


def _label(doc: dict) -> str:
    """Device and dtype, marked when the bench run was cut short."""
    n = len(doc["results"])
    partial = "" if doc.get("complete", True) else f" (partial run: {n} batch size{'s' * (n != 1)})"
    return f"{doc['device']} ({doc['dtype']}){partial}"


def _setup(doc: dict) -> str:
    """What besides the device sets a file's numbers: drafts per round, drafter and answer length."""
    sha = doc.get("drafter_sha256")
    drafter = doc.get("drafter", "?") + (f" (sha256 {sha[:8]})" if sha else "")
    return f"k = {doc.get('draft_len', '?')}, drafter {drafter}, {doc['max_new_tokens']} new tokens"


def _tps(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def render_markdown(docs: list[dict]) -> str:
    lines = ["# specformer benchmark report", "",
             "Plain = autoregressive decoding, one token per step; speculative = SpecFormer drafting k tokens per "
             "round, AL = mean accepted length (tokens per round). Roofline: t = max(bytes / bandwidth, FLOPs / peak) "
             "per plain step and per speculative round (`specformer_jax/bench/roofline.py`), the speculative one at "
             "the measured AL; `% of roofline` = measured / roofline tokens/s.", ""]
    setups = {_setup(doc) for doc in docs}
    if len(docs) > 1:
        lines += ["## Speedup side by side", ""]
        if len(setups) > 1:
            lines += ["The files differ in more than the device (draft length, drafter or answer length): "
                      + "; ".join(f"{_label(d)}: {_setup(d)}" for d in docs) + ".", ""]
        by_file = [{_key(r): r for r in estimate(doc)} for doc in docs]
        lines += ["| batch | " + " | ".join(_label(d) for d in docs) + " |",
                  "|---:|" + "---:|" * len(docs)]
        for b in sorted({b for rows in by_file for b in rows}):
            cells = [f"{rows[b]['speedup']:.2f}x (roofline {rows[b]['speedup_roofline']:.2f}x)"
                     if "spec" in rows.get(b, {}) else "" for rows in by_file]
            shown = next(rows[b] for rows in by_file if b in rows)
            lines.append(f"| {_batch(shown)} | " + " | ".join(cells) + " |")
        lines.append("")
    for doc in docs:
        bw, peak, source = device_limits(doc)
        v = doc.get("versions", {})
        lines += [f"## {_label(doc)}", "",
                  f"`{doc.get('command', '?')}` → `{doc['_path']}`  ",
                  f"model {doc.get('model', '?')}, {_setup(doc)}, {doc['num_prompts']} prompts, "
                  f"jax {v.get('jax', '?')}; limits ({source}): {bw / 1e9:,.0f} GB/s, {peak / 1e12:.1f} TFLOP/s", "",
                  "| batch | plain tok/s | plain roofline tok/s | % of roofline | k | AL | speculative tok/s "
                  "| speculative roofline tok/s | % of roofline | speedup | roofline speedup | same output |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in estimate(doc):
            cells = [_batch(r), _tps(r["ar"]), _tps(r["ar_roofline"]), f"{100 * r['ar'] / r['ar_roofline']:.0f}%"]
            if "spec" in r:
                eq = "" if r["equivalence"] is None else f"{100 * r['equivalence']:.0f}%"
                law = "" if r["law_al"] is None else f" (law {r['law_al']:.2f})"
                cells += [r["k"], f"{r['al']:.2f}{law}", _tps(r["spec"]), _tps(r["spec_roofline"]),
                          f"{100 * r['spec'] / r['spec_roofline']:.0f}%", f"{r['speedup']:.2f}x",
                          f"{r['speedup_roofline']:.2f}x", eq]
            else:
                cells += ["0"] + [""] * 7
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines += [""] + _tpu_lines(doc)
    return "\n".join(lines)


def _tpu_lines(doc: dict) -> list[str]:
    """The file's TPU roofline estimates as a Markdown table (none when it has no speculative rows)."""
    rows = tpu_estimates(doc)
    if not rows:
        return []
    lines = [f"Estimates, not measurements: the roofline speedup of the same model, batch sizes, k and measured AL "
             f"on TPUs ({doc['dtype']}, published bandwidth and matmul peak).", "",
             "| batch | k | AL | " + " | ".join(f"{d} (estimate)" for d in TPU_ESTIMATES) + " |",
             "|---:|---:|---:|" + "---:|" * len(TPU_ESTIMATES)]
    for r in rows:
        lines.append(f"| {_batch(r)} | {r['k']} | {r['al']:.2f} | "
                     + " | ".join(f"{r[d]:.2f}x" for d in TPU_ESTIMATES) + " |")
    return lines + [""]


def plot_report(docs: list[dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    lines = [(doc, rate) for doc in docs for rate in dict.fromkeys(r.get("set_acceptance") for r in doc["results"])]
    for i, (doc, rate) in enumerate(lines):
        rows = [r for r in estimate(doc) if "spec" in r and r["rate"] == rate]
        if not rows:
            continue
        bs = [r["batch_size"] for r in rows]
        label = f"{_label(doc)}, {_setup(doc)}" + ("" if rate is None else f", set acceptance {rate:g}")
        ax.plot(bs, [r["speedup"] for r in rows], "o-", color=f"C{i}", label=f"{label}: measured")
        ax.plot(bs, [r["speedup_roofline"] for r in rows], "--", color=f"C{i}", label=f"{label}: roofline")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size", ylabel="speedup over plain decoding", title="SpecFormer speculative decoding")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1)
    fig.tight_layout()
    save_figure(fig, out_png)
