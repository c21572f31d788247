"""llama.cpp's prompt lookup decoding (`llama-lookup`) as the peer of `--drafter ngram`: the same float32 weights
(peers.f32_gguf), the same prompts through the same chat template, greedy, batch 1, `--max-new-tokens` tokens.

Each prompt is one `llama-lookup` call per side: `--spec-draft-n-max 0` (its loop with no drafts: llama.cpp's
plain decoding, the baseline of its ratio) and `--spec-draft-n-max K` for each K of `--draft-max`. A side's tokens/s
is its decoded tokens over its decoding seconds (llama-lookup's own timer: the prompt's prefill left out), summed over
the prompts, each prompt counting no more tokens than plain decoding gave it (`side_totals`); its speedup is the
median over repeats of that against the plain side of the same repeat (sides in alternating order each repeat).
Accepted length = tokens decoded / rounds, a round being each target pass after the prompt (n_predict - n_accept of
them). Build llama-lookup from the `llama-cpp-python` sdist (benchmarks/README.md):

    .venv/bin/python benchmarks/llama_lookup.py --llama-lookup <build>/bin/llama-lookup --prompts editing \\
        --out benchmarks/results/llama_lookup_editing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import f32_gguf  # noqa: E402

from specformer_jax.assets import prompt_set  # noqa: E402
from specformer_jax.checkpoints.default import default_model_path  # noqa: E402
from specformer_jax.checkpoints.loader import load_target  # noqa: E402
from specformer_jax.decoding.encode import read_prompts_file  # noqa: E402

FIELDS = {"tokens": r"decoded\s+(\d+) tokens", "seconds": r"decoded\s+\d+ tokens in\s+([\d.]+) seconds",
          "prompt_tokens": r"encoded\s+(\d+) tokens", "drafted": r"n_drafted\s*=\s*(\d+)",
          "accepted": r"n_accept\s*=\s*(\d+)"}


def lookup_run(exe: str, gguf: Path, text: str, max_new: int, draft_max: int) -> dict:
    """One llama-lookup call on one prompt: its counts and decoding seconds."""
    cmd = [exe, "-m", str(gguf), "-p", text, "-n", str(max_new), "--spec-draft-n-max", str(draft_max), "-t",
           str(os.cpu_count()), "--temp", "0", "--top-k", "1", "-c", "2048"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"llama-lookup exited with {proc.returncode}: {last}")
    log = proc.stdout + proc.stderr
    found = {name: re.search(pattern, log) for name, pattern in FIELDS.items()}
    missing = [name for name, m in found.items() if m is None]
    if missing:
        raise SystemExit(f"llama-lookup printed no {missing[0]}: is {exe} llama.cpp's lookup example?")
    out = {name: float(m.group(1)) if name == "seconds" else int(m.group(1)) for name, m in found.items()}
    out["text"] = proc.stdout
    return out


def version(exe: str) -> str:
    """llama.cpp's version line, with its commit."""
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return next((line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("version")), "unknown")


def side_totals(runs: list[dict], plain: list[dict]) -> dict:
    """One side's calls over the prompts, against the plain calls of the same repeat. llama-lookup checks its token
    budget only after a round's accepted drafts, so it can decode a few tokens past it: each prompt counts no more
    tokens than plain decoding gave it (its seconds unchanged), and its output must start with plain's."""
    counted = sum(min(r["tokens"], p["tokens"]) for r, p in zip(runs, plain))
    seconds, decoded = sum(r["seconds"] for r in runs), sum(r["tokens"] for r in runs)
    return {"tokens": counted, "tokens_decoded": decoded, "seconds": seconds, "tokens_per_second": counted / seconds,
            "mean_accepted_length": decoded / sum(r["tokens"] - r["accepted"] for r in runs),
            "drafted": sum(r["drafted"] for r in runs), "accepted": sum(r["accepted"] for r in runs),
            "same_output_as_plain": sum(r["text"].startswith(p["text"].rstrip()) for r, p in zip(runs, plain))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--llama-lookup", default=shutil.which("llama-lookup"), help="the llama-lookup executable")
    ap.add_argument("--prompts", default="editing", help="a prompt set (chat, code, editing) or a JSONL file")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-max", default="3,7",
                    help="comma-separated draft lengths (3: llama-lookup's default, says its --help)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not args.llama_lookup:
        raise SystemExit("llama-lookup is not on the PATH: give --llama-lookup")
    model = load_target("default")
    gguf = f32_gguf(default_model_path())
    prompts = read_prompts_file(prompt_set(args.prompts))[: args.num_prompts]
    tok = model.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    sides = {"plain": 0} | {f"lookup@{k}": k for k in map(int, args.draft_max.split(","))}
    runs = {name: [] for name in sides}
    for i in range(args.repeats):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            runs[name].append([lookup_run(args.llama_lookup, gguf, t, args.max_new_tokens, sides[name]) for t in texts])
            print(f"llama_lookup: repeat {i + 1}, {name}: {len(runs[name][-1])} prompts", file=sys.stderr)
    ours = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    rows = {}
    for name in sides:
        per = [side_totals(r, p) for r, p in zip(runs[name], runs["plain"])]
        base = [side_totals(p, p) for p in runs["plain"]]
        rows[name] = {"tokens_per_second": statistics.median(p["tokens_per_second"] for p in per),
                      "speedup": statistics.median(p["tokens_per_second"] / q["tokens_per_second"]
                                                   for p, q in zip(per, base)),
                      "mean_accepted_length": per[-1]["mean_accepted_length"], "repeats": per}
    doc = {"command": " ".join(["benchmarks/llama_lookup.py", *sys.argv[1:]]), "cpu_count": os.cpu_count(),
           "platform": platform.platform(), "python": platform.python_version(), "model": str(gguf),
           "llama_lookup": args.llama_lookup, "llama_cpp_version": version(args.llama_lookup),
           "prompts": args.prompts, "num_prompts": len(texts),
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "prompt_tokens_match_ours": sum(r["prompt_tokens"] == n for r, n in zip(runs["plain"][-1], ours)),
           "sides": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print({name: (round(r["tokens_per_second"], 1), round(r["speedup"], 3), round(r["mean_accepted_length"], 2))
           for name, r in rows.items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
