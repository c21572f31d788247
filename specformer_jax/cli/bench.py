"""`specformer bench`, `specformer bench-kernels` and `specformer report`: measure decoding and kernels, and lay
result files from different devices side by side."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from pallas_kernels import IMPLS
from specformer_jax import defaults
from specformer_jax.assets import PROMPT_SETS, prompt_set
from specformer_jax.checks import POSITIVE_INT
from specformer_jax.cli import args as a
from specformer_jax.cli.decode import VERIFY_BUDGET_HELP, draft_len, verify_budget
from specformer_jax.errors import SpecformerError
from specformer_jax.files import write_atomic, write_json


def add_parsers(sub) -> None:
    p = sub.add_parser("bench", help="AR vs speculative decoding throughput per batch size",
                       description="Plain and speculative decoding of the same prompts, in one process.")
    a.add_model(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: the checkpoint's (GGUF: float32; random:NAME: bfloat16)")
    p.add_argument("--drafter", default="default",
                   help=f"'default' (with a random:NAME model: 'random'), a shipped one by name ({a.SHIPPED_NAMES}), a "
                        "drafter directory, 'random' (random weights, 8 slots), 'ngram', 'default+ngram' or "
                        "'DIR+ngram' (as in generate) or 'none' (AR only)")
    p.add_argument("--set-acceptance", type=a.rate_list("--set-acceptance"), default=None,
                   help="comma-separated rates, e.g. 0.5,0.7,0.8: a row per rate, its speculative side accepting each "
                        "draft with that probability (the ones before it accepted) instead of verifying: the cost "
                        "of a drafter with that acceptance; the text is meaningless")
    p.add_argument("--prompts", type=prompt_set, default=PROMPT_SETS["chat"],
                   help="a prompt set shipped with the package (chat, the default; code; editing: answers that copy "
                        "their input) or a JSONL file of prompts")
    p.add_argument("--batch-sizes", type=a.int_list("--batch-sizes"), default=[1, 8],
                   help="comma-separated, e.g. 1,4,16,64")
    p.add_argument("--draft-len", type=draft_len, default=None,
                   help="drafts per round, or auto (per batch size); default as in generate: "
                        + defaults.draft_len_defaults_text())
    p.add_argument("--verify-budget", type=verify_budget, default=None, help=VERIFY_BUDGET_HELP)
    p.add_argument("--max-new-tokens", type=a.kind(POSITIVE_INT), default=64)
    p.add_argument("--repeats", type=a.kind(POSITIVE_INT), default=3,
                   help="timed runs of each side, alternating plain and speculative; medians reported (default 3)")
    p.add_argument("--num-requests", type=a.kind(POSITIVE_INT), default=None,
                   help="a request stream: the prompts cycled to N requests, each to its natural answer length up "
                        "to --max-new-tokens (default: the prompts, at least one full batch)")
    a.add_device_options(p)
    a.add_engine_options(p, ("continuous", "static", "both"))
    p.add_argument("--out", type=a.out_file, required=True, help="result JSON")
    p.add_argument("--plot", type=a.out_file, help="also draw tokens/s per batch size to this PNG")
    p.set_defaults(func=run_bench)
    _add_profile_round(sub)
    _add_bench_kernels(sub)
    p = sub.add_parser("report", help="bench result files side by side with roofline estimates",
                       description="Lay `specformer bench` result files (any devices) side by side, each held against "
                                   "a roofline estimate of plain and speculative decoding.")
    p.add_argument("results", nargs="+", type=Path, help="result JSON files from `specformer bench`")
    p.add_argument("--out", type=a.out_file, required=True, help="Markdown report")
    p.add_argument("--plot", type=a.out_file, help="also draw measured and roofline speedup per batch size to this PNG")
    p.set_defaults(func=run_report)


def _add_profile_round(sub) -> None:
    p = sub.add_parser("profile-round", help="what each part of a speculative round costs, in plain steps",
                       description="Time each part of a speculative round (the target's forward over k + 1 tokens, "
                                   "the LM head, acceptance, bookkeeping, the drafter's layers and head) against "
                                   "the parts of a plain step, on the engine's own functions, in one process.")
    a.add_model(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: the checkpoint's (GGUF: float32; random:NAME: bfloat16)")
    p.add_argument("--drafter", default="default",
                   help=f"'default' (with a random:NAME model: 'random'), {a.SHIPPED_NAMES}, a drafter directory, or "
                        "'random'")
    p.add_argument("--batch-sizes", type=a.int_list("--batch-sizes"), default=[1, 8], help="e.g. 1,8,64")
    p.add_argument("--draft-lens", type=a.int_list("--draft-lens"), default=[1, 2, 3, 4],
                   help="drafts per round to profile, each against the plain step (default 1,2,3,4)")
    p.add_argument("--budgets", type=a.int_list("--budgets", from_zero=True, like="0,2,4"), default=[],
                   help="also rounds of the largest --draft-lens k with a verify budget of the batch size plus each "
                        "of these positions, e.g. 0,2,4,8: the round and its flat verify pass, timed")
    p.add_argument("--context", type=a.kind(POSITIVE_INT), default=72,
                   help="tokens in every row's cache (default 72: the benchmark prompts' mean, 41, and half of "
                        "bench's 64 new tokens)")
    p.add_argument("--chunk-rounds", type=a.kind(POSITIVE_INT), default=defaults.CHUNK_ROUNDS,
                   help=f"rounds per chunk (R, default {defaults.CHUNK_ROUNDS})")
    p.add_argument("--repeats", type=a.kind(POSITIVE_INT), default=20,
                   help="timings of every part, in turn; medians reported (default 20)")
    p.add_argument("--attention-impl", choices=IMPLS, default="auto", help="as for bench")
    p.add_argument("--out", type=a.out_file, required=True, help="result JSON")
    p.add_argument("--table", type=a.out_file, help="also write the tables as Markdown to this file")
    p.set_defaults(func=run_profile_round)


def _add_bench_kernels(sub) -> None:
    p = sub.add_parser("bench-kernels", help="Pallas attention kernel vs the XLA reference at verify shapes",
                       description="Time the ragged attention kernel against the jnp/XLA reference, with achieved "
                                   "memory bandwidth against the measured read bandwidth.")
    p.add_argument("--batch-sizes", type=a.int_list("--batch-sizes"), default=[1, 8, 64])
    p.add_argument("--queries", type=a.int_list("--queries"), default=[5, 9], help="new tokens per row (k + 1)")
    p.add_argument("--cache-lens", type=a.int_list("--cache-lens"), default=[1024, 4096, 8192])
    p.add_argument("--heads", type=a.kind(POSITIVE_INT), default=32)
    p.add_argument("--kv-heads", type=a.kind(POSITIVE_INT), default=8)
    p.add_argument("--head-dim", type=a.kind(POSITIVE_INT), default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--impl", choices=IMPLS, default="pallas", help="the kernel side (interpret: a CPU smoke run)")
    p.add_argument("--repeats", type=a.kind(POSITIVE_INT), default=20)
    p.add_argument("--chain", type=a.kind(POSITIVE_INT), default=1,
                   help="time N dependent calls in one jitted call and divide by N, so per-call dispatch drops out")
    p.add_argument("--out", type=a.out_file, required=True, help="result JSON")
    p.set_defaults(func=run_bench_kernels)


def run_bench(args) -> int:
    from specformer_jax.bench.plot import plot_bench
    from specformer_jax.bench.run import run_benchmark
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.encode import read_prompts_file
    from specformer_jax.decoding.names import read_drafter

    prompts = read_prompts_file(args.prompts)
    name = read_drafter(args.drafter).on(args.model)
    model = load_target(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    drafter = name.load(model)
    a.drafter_needed(drafter, args.draft_len, "; --drafter none times plain decoding only")
    if args.set_acceptance and (drafter is None or args.draft_len in (0, None, "auto")):
        raise SpecformerError("--set-acceptance needs speculative decoding with a fixed --draft-len (and a drafter)")
    head = {"command": "specformer " + shlex.join(args.argv), "model": args.model, "drafter": name.text}
    # written after every batch size, so an interrupted run keeps the batch sizes it finished
    result = run_benchmark(model, drafter, prompts, batch_sizes=args.batch_sizes, draft_len=args.draft_len,
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats, num_requests=args.num_requests,
                           schedules=("continuous", "static") if args.schedule == "both" else (args.schedule,),
                           chunk_rounds=args.chunk_rounds, mesh=a.mesh(args),
                           records=a.records(), on_progress=lambda doc: write_json(args.out, {**head, **doc}),
                           set_acceptance=args.set_acceptance, drafter_name=name.text,
                           verify_budget=args.verify_budget)
    if args.plot:
        plot_bench({**head, **result}, args.plot)
    print(f"specformer: wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0


def run_profile_round(args) -> int:
    from specformer_jax.bench.round_profile import profile_rounds, render_markdown
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import read_drafter

    name = read_drafter(args.drafter).on(args.model).specformer("profile-round")
    model = load_target(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    drafter = name.load(model)
    bad = [k for k in args.draft_lens if not 1 <= k <= drafter.cfg.num_slots]
    if bad:
        raise SpecformerError(f"--draft-lens must lie in 1..{drafter.cfg.num_slots} for this drafter, got {bad[0]}")
    head = {"command": "specformer " + shlex.join(args.argv), "model": args.model, "drafter": name.text}

    def write(doc):  # after every batch size, so an interrupted run keeps what it measured
        write_json(args.out, {**head, **doc})
        if args.table:
            write_atomic(args.table, render_markdown(doc) + "\n")

    profile_rounds(model, drafter, batch_sizes=args.batch_sizes, draft_lens=args.draft_lens, context=args.context,
                   chunk_rounds=args.chunk_rounds, repeats=args.repeats, on_progress=write, budgets=args.budgets)
    print(f"specformer: wrote {args.out}" + (f" and {args.table}" if args.table else ""), file=sys.stderr)
    return 0


def run_bench_kernels(args) -> int:
    from pallas_kernels import resolve
    from specformer_jax.bench.kernels import run_kernel_benchmark

    if args.heads % args.kv_heads:
        raise SpecformerError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    try:
        resolve(args.impl, args.head_dim)
    except ValueError as e:
        raise SpecformerError(str(e)) from None
    head = {"command": "specformer " + shlex.join(args.argv)}
    # written after every shape, so an interrupted run keeps the shapes it timed
    run_kernel_benchmark(batch_sizes=args.batch_sizes, queries=args.queries, cache_lens=args.cache_lens,
                         num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                         impl=args.impl, repeats=args.repeats, chain=args.chain,
                         on_progress=lambda doc: write_json(args.out, {**head, **doc}))
    print(f"specformer: wrote {args.out}", file=sys.stderr)
    return 0


def run_report(args) -> int:
    from specformer_jax.bench.report import load_results, plot_report, render_markdown

    docs = load_results(args.results)
    write_atomic(args.out, render_markdown(docs) + "\n")
    if args.plot:
        plot_report(docs, args.plot)
    print(f"specformer: wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0
