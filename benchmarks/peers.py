"""CPU decoding speed of specformer_jax against the tools a user would try, on the same weights and prompts.

What it measures, in one process, at each `--batch-sizes` B (greedy, `--max-new-tokens` answer tokens, stop at EOS):

- ours: `specformer_jax.decoding.api.generate` with plain decoding, and speculative decoding with the shipped
  drafter (draft_len=1) as a second row;
- transformers: PyTorch `model.generate` (do_sample=False, torch threads = os.cpu_count()), the model loaded from
  the same GGUF with `gguf_file=` (dequantized to float32; checked to be bit-identical to ours, else our weights are
  copied in), prompts decoded in left-padded batches of B rows with an attention mask and pad token = EOS;
- llama.cpp, when `llama-bench` is on the PATH, batch 1 only: `llama-bench -p 0 -n <max_new_tokens> -t <cores>
  -r 1 -o json` (token generation from an empty context, no EOS; its own timer, which leaves out the prompt's
  prefill that the other tools' wall time includes) on a float32 GGUF holding exactly our weights
  (written once into specformer's cache directory) and on the shipped Q4_1 GGUF, what llama.cpp users run.

Every tool gets the same token ids: the first `--num-prompts` prompts of `--prompts` through the chat template
(`encode_prompts`). Each tool runs once untimed (compilation, warm-up), then `--repeats` timed rounds follow with
the tools in alternating order (ABC, CBA, ...), so a machine slowing down for a while slows all of them alike.
tokens/s = generated tokens (up to and including EOS, not the padding after it) / wall seconds of the timed call
(for ours the whole `generate` call; its own loop-only figure is kept as `internal_tokens_per_second`). Each tool's
figure is the median of its runs; ratios are ours' median over the peer's. `greedy_match` is the fraction of prompts
whose greedy tokens are identical (ours against transformers, speculative against plain).

Run it on an otherwise idle machine:

    .venv/bin/python benchmarks/peers.py --out benchmarks/results/peers_cpu.json

A quick check: `--max-new-tokens 8 --repeats 1 --batch-sizes 1`. The result is a JSON file (`--out`, rewritten after
every batch size with "complete": false until the last) and a table on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "specformer_jax" / "assets" / "eval-prompts.jsonl"
LLAMA_NOT_FOUND = "not found on PATH"


@dataclasses.dataclass
class Run:
    """One call of a tool over all prompts: generated tokens, wall seconds, token ids per prompt (None: unknown)."""

    tokens: int
    seconds: float
    token_ids: list[list[int]] | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# --- arguments

def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [_positive(s.strip()) for s in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None
    return list(dict.fromkeys(sizes))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="result JSON file")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8], help="comma-separated (default 1,8)")
    p.add_argument("--max-new-tokens", type=_positive, default=64)
    p.add_argument("--repeats", type=_positive, default=3, help="timed runs per tool and batch size (median)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompts JSONL (default: eval prompts)")
    p.add_argument("--num-prompts", type=_positive, default=8, help="the first N prompts of --prompts (default 8)")
    args = p.parse_args(argv)
    if not args.out.parent.is_dir():
        p.error(f"--out: directory {args.out.parent} does not exist")
    if args.out.is_dir():
        p.error(f"--out: {args.out} is a directory")
    if not args.prompts.is_file():
        p.error(f"--prompts: {args.prompts} is not a file")
    return args


# --- facts

def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def device_facts() -> dict:
    import flax
    import jax
    import torch
    import transformers

    return {
        "processor": platform.processor(), "cpu_model": _cpu_model(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(), "jax_device": jax.devices()[0].device_kind,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
                     "flax": flax.__version__, "transformers": transformers.__version__, "numpy": np.__version__},
    }


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    """The generated ids up to and including the first EOS (what follows is padding)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def _first_prompts(model, path: Path, n: int) -> list[list[int]]:
    from specformer_jax.decoding.encode import encode_prompts, read_prompts_file

    return encode_prompts(model, read_prompts_file(path)[:n])


# --- ours

def ours_tool(model, ids: list[list[int]], max_new_tokens: int, drafter=None) -> Callable[[int], Run]:
    """Our `generate` over every prompt at batch size B (token ids given, so no tokenizing is timed)."""
    from specformer_jax.decoding.api import generate

    spec = dict(drafter=drafter, draft_len=1) if drafter is not None else dict(drafter=None)

    def run(batch_size: int) -> Run:
        t = time.perf_counter()
        res = generate(model, ids, max_new_tokens=max_new_tokens, batch_size=batch_size, **spec)
        seconds = time.perf_counter() - t
        extra = {"internal_tokens_per_second": res.stats["tokens_per_second"],
                 "internal_run_seconds": res.stats["run_seconds"]}
        return Run(res.stats["num_generated"], seconds, res.token_ids, extra)

    return run


# --- transformers

def _our_state_dict(model) -> dict:
    """Our parameters under Hugging Face names, as torch tensors in HF's [out, in] layout."""
    import jax
    import torch

    from specformer_jax.checkpoints.convert import hf_name

    out = {}
    for path, v in jax.tree_util.tree_leaves_with_path(model.params):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        v = np.asarray(v, np.float32)
        pieces = [(hf_name(keys, i), v[i]) for i in range(v.shape[0])] if keys[0] == "layers" else [(hf_name(keys), v)]
        for name, w in pieces:
            out[name] = torch.from_numpy((w.T if keys[-1] == "kernel" else w).copy())
    return out


def load_transformers(model, gguf_path: Path):
    """(the PyTorch model loaded from the GGUF by transformers, how its weights relate to ours)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                           dtype=torch.float32).eval()
    ours, theirs = _our_state_dict(model), hf.state_dict()
    differ = [k for k, w in ours.items() if k not in theirs or not torch.equal(theirs[k], w)]
    if not differ:
        return hf, "loaded with transformers from the GGUF (gguf_file=): bit-identical to ours"
    hf.load_state_dict(ours, strict=False)
    return hf, f"loaded from the GGUF, then ours copied in ({len(differ)} tensors differed, e.g. {differ[0]})"


def transformers_tool(hf, ids: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...]) -> Callable[[int], Run]:
    """PyTorch `generate` over every prompt in left-padded batches of B rows; wall time of the generate calls."""
    import torch
    import transformers

    pad = eos_ids[0]
    cfg = transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                        eos_token_id=list(eos_ids), pad_token_id=pad)

    def batch(rows: list[list[int]]):
        T = max(map(len, rows))
        tokens = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
        return tokens, mask

    def run(batch_size: int) -> Run:
        seconds, out = 0.0, []
        for i in range(0, len(ids), batch_size):
            tokens, mask = batch(ids[i: i + batch_size])
            with torch.inference_mode():
                t = time.perf_counter()
                gen = hf.generate(input_ids=tokens, attention_mask=mask, generation_config=cfg)
                seconds += time.perf_counter() - t
            out += [_until_eos(row, set(eos_ids)) for row in gen[:, tokens.shape[1]:].tolist()]
        return Run(sum(map(len, out)), seconds, out)

    return run


# --- llama.cpp

def f32_gguf(src: Path) -> Path:
    """A float32 copy of a GGUF (same metadata, tensors dequantized by the gguf package as our loader does, in
    llama.cpp's layout), written once into specformer's cache directory: llama.cpp then runs on exactly our weights."""
    import gguf

    from specformer_jax.files import cache_dir

    dest = cache_dir() / (src.name.removesuffix(".gguf") + ".F32.gguf")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file():
        return dest
    reader = gguf.GGUFReader(src)
    part = dest.with_name(dest.name + f".part{os.getpid()}")
    writer = gguf.GGUFWriter(part, reader.fields["general.architecture"].contents())
    for f in reader.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = int(gguf.LlamaFileType.ALL_F32) if f.name == "general.file_type" else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, dest)
    return dest


def llama_bench_cmd(exe: str, gguf_path: Path, max_new_tokens: int) -> list[str]:
    return [exe, "-m", str(gguf_path), "-p", "0", "-n", str(max_new_tokens), "-t", str(os.cpu_count()),
            "-r", "1", "-o", "json"]


def llama_tool(cmd: list[str]) -> Callable[[int], Run]:
    """One llama-bench invocation (its own warm-up, then one timed generation of max_new_tokens tokens)."""

    def run(batch_size: int) -> Run:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"llama-bench exited with {proc.returncode}: {last}")
        rec = json.loads(proc.stdout)[0]
        extra = {k: rec.get(k) for k in ("build_commit", "model_type", "n_threads", "cpu_info", "backends")}
        return Run(int(rec["n_gen"]), rec["avg_ns"] / 1e9, None, extra)

    return run


# --- timing

def time_tools(tools: dict[str, Callable[[int], Run]], batch_size: int, repeats: int, log) -> dict[str, list[Run]]:
    """One untimed call per tool, then `repeats` rounds with the tools in alternating order."""
    for name, tool in tools.items():
        print(f"peers: batch {batch_size}: warming up {name}", file=log)
        tool(batch_size)
    runs: dict[str, list[Run]] = {name: [] for name in tools}
    for i in range(repeats):
        for name in list(tools) if i % 2 == 0 else list(tools)[::-1]:
            runs[name].append(tools[name](batch_size))
    return runs


def _match(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def _first_difference(a: list[list[int]], b: list[list[int]]) -> list[dict]:
    """Per differing prompt: its index and the first answer position where the tokens differ."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            out.append({"prompt": i, "position": pos, "ours": x[pos: pos + 4], "theirs": y[pos: pos + 4]})
    return out


def summarize(runs: dict[str, list[Run]]) -> dict:
    out = {}
    for name, rs in runs.items():
        row = {"tokens_per_second": statistics.median(r.tokens_per_second for r in rs),
               "tokens_per_second_runs": [r.tokens_per_second for r in rs],
               "seconds_runs": [r.seconds for r in rs], "num_generated": rs[-1].tokens}
        for key in rs[-1].extra:
            vals = [r.extra[key] for r in rs]
            row[key] = statistics.median(vals) if isinstance(vals[0], float) else vals[-1]
        out[name] = row
    return out


def ratios(tools: dict) -> dict:
    out = {}
    for mine in ("ours", "ours_speculative"):
        for peer in ("transformers", "llama_cpp_f32", "llama_cpp_q4_1"):
            a, b = tools.get(mine, {}), tools.get(peer, {})
            if a.get("tokens_per_second") and b.get("tokens_per_second"):
                out[f"{mine}/{peer}"] = a["tokens_per_second"] / b["tokens_per_second"]
    return out


def _load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def batch_row(tools: dict[str, Callable[[int], Run]], batch_size: int, repeats: int, skipped: dict, log) -> dict:
    """One batch size: the tools' timings, the ratios, greedy agreement, and the 1/5/15-minute load averages before
    and after (well above the core count: other processes were competing for the cores)."""
    before = _load_average()
    runs = time_tools(tools, batch_size, repeats, log)
    summary = {**summarize(runs), **skipped}
    ours = runs["ours"][-1].token_ids
    row = {"batch_size": batch_size, "load_average_before": before, "load_average_after": _load_average(),
           "tools": summary, "ratios": ratios(summary), "greedy_match": {}}
    for peer in ("transformers", "ours_speculative"):
        if peer in runs:
            row["greedy_match"][f"{peer}_vs_ours"] = _match(ours, runs[peer][-1].token_ids)
            row.setdefault("greedy_differences", {})[peer] = _first_difference(ours, runs[peer][-1].token_ids)
    return row


# --- output

def print_table(doc: dict, log) -> None:
    print(f"\n{'batch':>5}  {'tool':<18} {'tok/s':>9}  runs", file=log)
    for row in doc["results"]:
        for name, t in row["tools"].items():
            if "tokens_per_second" in t:
                runs = " ".join(f"{v:.1f}" for v in t["tokens_per_second_runs"])
                print(f"{row['batch_size']:>5}  {name:<18} {t['tokens_per_second']:>9.1f}  {runs}", file=log)
            else:
                print(f"{row['batch_size']:>5}  {name:<18} {'-':>9}  {t['status']}", file=log)
        shown = ", ".join(f"{k} {v:.2f}x" for k, v in row["ratios"].items())
        match = ", ".join(f"{k} {v:.2f}" for k, v in row["greedy_match"].items())
        print(f"{'':>5}  ratios: {shown or '-'}\n{'':>5}  greedy match: {match}", file=log)


def llama_tools(gguf_path: Path, max_new_tokens: int, log) -> tuple[dict, dict]:
    """(llama.cpp tools for batch 1, facts about them): empty tools when llama-bench is not on the PATH."""
    exe = shutil.which("llama-bench")
    if exe is None:
        return {}, {"status": LLAMA_NOT_FOUND}
    print("peers: llama.cpp: preparing a float32 GGUF of our weights", file=log)
    files = {"llama_cpp_f32": f32_gguf(gguf_path), "llama_cpp_q4_1": gguf_path}
    cmds = {name: llama_bench_cmd(exe, path, max_new_tokens) for name, path in files.items()}
    return ({name: llama_tool(cmd) for name, cmd in cmds.items()},
            {"status": "found", "llama_bench": exe, "commands": {k: " ".join(v) for k, v in cmds.items()}})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = sys.stderr
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws a bar; read when tqdm is imported
    import torch

    torch.set_num_threads(os.cpu_count())
    from specformer_jax.checkpoints.default import default_model_path
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import resolve_drafter
    from specformer_jax.files import write_json

    print("peers: loading the default model, the drafter and transformers' model", file=log)
    gguf_path = default_model_path()
    model = load_target(str(gguf_path))
    ids = _first_prompts(model, args.prompts, args.num_prompts)
    hf, hf_weights = load_transformers(model, gguf_path)
    tools = {"ours": ours_tool(model, ids, args.max_new_tokens),
             "ours_speculative": ours_tool(model, ids, args.max_new_tokens, resolve_drafter("default", model)),
             "transformers": transformers_tool(hf, ids, args.max_new_tokens, model.eos_ids)}
    llama, llama_facts = llama_tools(gguf_path, args.max_new_tokens, log)
    doc = {"command": " ".join(sys.argv if argv is None else ["benchmarks/peers.py", *argv]),
           "device": device_facts(), "model": str(gguf_path), "dtype": model.cfg.dtype,
           "prompts": str(args.prompts), "num_prompts": len(ids), "mean_prompt_tokens": sum(map(len, ids)) / len(ids),
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "batch_sizes": args.batch_sizes,
           "draft_len": 1, "transformers_weights": hf_weights, "llama_cpp": llama_facts,
           "results": [], "complete": False}
    for bs in args.batch_sizes:
        here = {**tools, **(llama if bs == 1 else {})}
        skipped = {} if bs == 1 else {"llama_cpp": {"status": "batch 1 only (llama-bench times one sequence)"}}
        if not llama:
            skipped = {"llama_cpp": {"status": LLAMA_NOT_FOUND}}
        doc["results"].append(batch_row(here, bs, args.repeats, skipped, log))
        doc["complete"] = len(doc["results"]) == len(args.batch_sizes)
        write_json(args.out, doc)
    print_table(doc, log)
    print(f"peers: wrote {args.out}", file=log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
