"""`specformer generate`: decode prompts with a target model, speculatively when a drafter is given."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specformer_jax import defaults
from specformer_jax.checks import NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE_INT, PROBABILITY, SEED, checked_budget
from specformer_jax.cli import args as a
from specformer_jax.errors import SpecformerError


def add_parsers(sub) -> None:
    p = sub.add_parser("generate", help="decode prompts with a target model",
                       description="Decode prompts on the device.")
    a.add_model(p)
    p.add_argument("--prompt", action="extend", nargs="+", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSONL with {"prompt": ...} or {"input_ids": [...]} per line')
    p.add_argument("--max-new-tokens", type=a.kind(POSITIVE_INT), default=128)
    p.add_argument("--temperature", type=a.kind(NON_NEGATIVE), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=a.kind(PROBABILITY), default=1.0)
    p.add_argument("--top-k", type=a.kind(NON_NEGATIVE_INT), default=0, help="0 = off")
    p.add_argument("--seed", type=a.kind(SEED), default=0)
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=8)
    p.add_argument("--max-cache-len", type=a.kind(POSITIVE_INT), default=None,
                   help="default: the model's context length")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: the checkpoint's (GGUF: float32; random:NAME: bfloat16)")
    a.add_device_options(p)
    a.add_engine_options(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--json", action="store_true", help="print one JSON document with results and stats")
    p.add_argument("--drafter", default=None,
                   help=f"'default' (shipped for the default model; by name {a.SHIPPED_NAMES}; with a random:NAME "
                        "model: 'random'), a drafter directory, 'ngram' (drafts looked up in the prompt and answer so "
                        "far: any model, no training; 'ngram:MIN-MAX' sets the n tried, default 1-4), 'default+ngram' "
                        "or 'DIR+ngram' (per row the source whose drafts are expected to have more accepted; the "
                        f"n-gram's need {defaults.HYBRID_MIN_MATCH}+ matching tokens), 'random' (random weights, 8 "
                        "slots: for speed) or 'none' for plain decoding; default: the shipped drafter when --model "
                        "is default, else none")
    p.add_argument("--draft-len", type=draft_len, default=None,
                   help="drafts per round: 1..trained slots (1..16 with ngram), 0 = off, or auto (a SpecFormer "
                        "drafter alone: chosen per batch size from measured costs); default: "
                        + defaults.draft_len_defaults_text())
    p.add_argument("--verify-budget", type=verify_budget, default=None, help=VERIFY_BUDGET_HELP)
    p.set_defaults(func=run_generate)


VERIFY_BUDGET_HELP = ("positions a speculative round verifies over the whole pool, N or +N (the batch size plus N): "
                      "every live row's last token, then the drafts most likely to be accepted across rows; auto: "
                      "each round the size that pays best, from a few whose costs are measured on this device once, or "
                      "plain decoding where none is predicted to; "
                      "0: every row all its drafts; default: the measured budget with the default draft length, 0 "
                      "with --draft-len K")


def verify_budget(text: str) -> int | str:
    """--verify-budget (here and in `bench`): N positions, +N (the batch size plus N) or auto, as `checked_budget`
    takes them."""
    try:
        return checked_budget(text if text.startswith("+") or text == "auto" else NON_NEGATIVE_INT.parse(text))
    except SpecformerError:
        raise argparse.ArgumentTypeError(f"expected N, +N (a whole number of positions) or auto, got {text!r}"
                                         ) from None


def draft_len(text: str) -> int | str:
    """--draft-len (here and in `bench`): a number of drafts per round, or "auto"."""
    if text == "auto":
        return text
    try:
        return NON_NEGATIVE_INT.parse(text)
    except SpecformerError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or auto, got {text!r}") from None


def run_generate(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.api import generate
    from specformer_jax.decoding.encode import read_prompts_file
    from specformer_jax.decoding.names import implied_drafter, read_drafter

    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise SpecformerError("no prompts: give --prompt TEXT or --prompts-file F.jsonl")
    name = (read_drafter(args.drafter) if args.drafter is not None else implied_drafter(args.model)).on(args.model)
    t = time.perf_counter()
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    drafter = name.load(model)
    if args.max_cache_len and args.max_cache_len > model.cfg.max_position:
        print(f"specformer: warning: --max-cache-len {args.max_cache_len} is past the model's context length "
              f"({model.cfg.max_position}): positions beyond it were never trained", file=sys.stderr)
    a.drafter_needed(drafter, args.draft_len, ": pass --drafter DIR (this run decodes plainly)")
    load_s = time.perf_counter() - t
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, batch_size=args.batch_size, chat=not args.no_chat,
                   max_cache_len=args.max_cache_len, drafter=drafter, draft_len=args.draft_len, mesh=a.mesh(args),
                   records=a.records(), schedule=args.schedule, chunk_rounds=args.chunk_rounds,
                   verify_budget=args.verify_budget)
    streamed = len(prompts) == 1 and not args.json and sys.stdout.isatty() and model.tokenizer is not None
    result = _streamed(model, prompts[0], options) if streamed else generate(model, prompts, progress=True, **options)
    result.stats["load_seconds"] = load_s
    result.stats["drafter"] = name.text
    _print_summary(result.stats, chosen=args.draft_len in (None, "auto"))
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        print()
    elif not streamed:
        for p, text, ids in zip(prompts, result.texts, result.token_ids):
            print(f">>> {_shown(p)}\n{text if text is not None else ids}\n")
    return 0


def _shown(prompt) -> str:
    """How a prompt heads its answer: its text, or how many token ids it has."""
    return prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"


def _streamed(model, prompt, options: dict):
    """Decode one prompt, printing its text as the chunks of rounds finish; returns the GenerationResult."""
    from specformer_jax.decoding.api import generate_stream

    events = generate_stream(model, [prompt], **options)
    print(f">>> {_shown(prompt)}", flush=True)
    ids, shown = [], ""
    while True:
        try:
            _, new = next(events)
        except StopIteration as end:
            print("\n", flush=True)
            return end.value
        ids += new
        text = model.tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # a character whose bytes are not all out yet waits for the next chunk
            print(text[len(shown):], end="", flush=True)
            shown = text


def _print_summary(s: dict, chosen: bool) -> None:
    """The stats line; `chosen`: the draft length was the default's or auto's, not the user's."""
    spec = (f", drafter {s['drafter']}, k = {s['draft_len']}, mean accepted length {s['mean_accepted_length']:.2f}"
            if "mean_accepted_length" in s else ", plain decoding")
    for name, by in s.get("by_source", {}).items():  # a hybrid: where the drafts came from
        spec += f"; {name} {by['share_of_rounds']:.0%} of rounds, accepted length {by['mean_accepted_length']:.2f}"
    if chosen and s.get("draft_len") == 0 and s.get("drafter") != "none":  # a drafter, but no draft length paid
        spec += f" (no draft length pays at batch {s['batch_size']} here; --draft-len K drafts anyway)"
    print(f"specformer: {s['num_generated']} tokens in {s['run_seconds']:.2f} s = {s['tokens_per_second']:.1f} "
          f"tokens/s (batch {s['batch_size']}, {s['device']}, {s['dtype']}{spec}; "
          f"compile {s['compile_seconds']:.1f} s, load {s['load_seconds']:.1f} s)", file=sys.stderr)
