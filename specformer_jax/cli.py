"""The `specformer` command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specformer_jax.errors import SpecformerError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _nonneg(kind):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a non-negative number, got {s!r}") from None
        if not v >= 0:
            raise argparse.ArgumentTypeError(f"expected a non-negative number, got {s!r}")
        return v

    return parse


def _probability(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}")
    return v


def read_prompts_file(path: Path) -> list:
    """JSONL: each line {"prompt": "..."} or {"input_ids": [...]}."""
    if not path.is_file():
        raise SpecformerError(f"prompts file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecformerError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("input_ids"), list) and all(
            isinstance(t, int) for t in rec["input_ids"]
        ):
            prompts.append(rec["input_ids"])
        else:
            raise SpecformerError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"input_ids": [ints]}}')
    if not prompts:
        raise SpecformerError(f"prompts file {path} has no prompts")
    return prompts


def _add_generate(sub):
    p = sub.add_parser("generate", help="decode prompts with a target model", description="Decode prompts on the device.")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF checkpoint dir or a .gguf file")
    p.add_argument("--prompt", action="extend", nargs="+", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSONL with {"prompt": ...} or {"input_ids": [...]} per line')
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=_nonneg(float), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_probability, default=1.0)
    p.add_argument("--top-k", type=_nonneg(int), default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-cache-len", type=_positive_int, default=None, help="default: the model's context length")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: checkpoint dtype (GGUF: float32)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--json", action="store_true", help="print one JSON document with results and stats")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.api import generate

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise SpecformerError("no prompts: give --prompt TEXT or --prompts-file F.jsonl")
    t = time.perf_counter()
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t
    result = generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        chat=not args.no_chat,
        max_cache_len=args.max_cache_len,
        progress=True,
    )
    result.stats["load_seconds"] = load_s
    s = result.stats
    print(
        f"specformer: {s['num_generated']} tokens in {s['run_seconds']:.2f} s = {s['tokens_per_second']:.1f} tokens/s "
        f"(batch {s['batch_size']}, {s['device']}, {s['dtype']}; compile {s['compile_seconds']:.1f} s, load {load_s:.1f} s)",
        file=sys.stderr,
    )
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        print()
    else:
        for p, text, ids in zip(prompts, result.texts, result.token_ids):
            shown = p if isinstance(p, str) else f"<{len(p)} token ids>"
            print(f">>> {shown}\n{text if text is not None else ids}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specformer", description="SpecFormer speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecformerError as e:
        print(f"specformer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specformer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
