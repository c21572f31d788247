"""`specformer sample-prompts`, `specformer distill`, `specformer pack-data` and `specformer cache-states`: the prompts
and the self-distilled data drafters train on, its compact form for keeping, and the target's states over it."""

from __future__ import annotations

import sys
from pathlib import Path

from specformer_jax.checks import POSITIVE, POSITIVE_INT, PROBABILITY, SEED
from specformer_jax.cli import args as a
from specformer_jax.errors import SpecformerError


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "sample-prompts",
        help="sample training prompts from the model itself (user requests it writes)",
        description="Prompt the model with its chat template up to a user turn and sample what the user says: "
        "distinct finished requests, written to a JSONL file for `specformer distill --prompts`. Rerun to resume or "
        "extend.",
    )
    a.add_model(p)
    p.add_argument("--num", type=a.kind(POSITIVE_INT), required=True, metavar="N", help="number of distinct prompts")
    p.add_argument("--out", type=a.out_file, required=True, metavar="F.jsonl")
    p.add_argument("--seed", type=a.kind(SEED), default=0)
    p.add_argument("--temperature", type=a.kind(POSITIVE), default=1.0)
    p.add_argument("--top-p", type=a.kind(PROBABILITY), default=0.95)
    p.add_argument("--max-new-tokens", type=a.kind(POSITIVE_INT), default=96, help="longer requests are dropped")
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=256)
    p.add_argument("--system", metavar="TEXT", help="a system message in place of the chat template's default one, "
                   "to steer the requests to a domain (e.g. 'You are a programming assistant.'); keep it the same "
                   "when resuming")
    p.set_defaults(func=run_sample_prompts)

    p = sub.add_parser(
        "distill",
        help="write the target's greedy answers to prompts as drafter training data",
        description="Self-distillation: greedy-decode training prompts with the target and write them as resumable "
        "JSONL shards. Rerun the same command to resume an interrupted run.",
    )
    a.add_model(p)
    p.add_argument("--prompts", type=Path, metavar="F.jsonl",
                   help='JSONL with {"prompt": ...} or {"input_ids": [...]} per line (e.g. from sample-prompts)')
    p.add_argument("--builtin-prompts", type=a.kind(POSITIVE_INT), metavar="N",
                   help="N prompts from the built-in set (before those of --prompts when both are given)")
    p.add_argument("--out", type=a.out_dir, required=True, metavar="DIR",
                   help="output directory (shards and manifest.json)")
    p.add_argument("--max-new-tokens", type=a.kind(POSITIVE_INT), default=256)
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=16)
    p.add_argument("--seed", type=a.kind(SEED), default=0, help="seed of --builtin-prompts")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--for-eval", action="store_true",
                   help="data to measure drafters on (a training run's eval_data, eval-drafter): evaluation prompts "
                   "such as the benchmark prompts are allowed, and `specformer train` refuses it as training data")
    p.set_defaults(func=run_distill)

    p = sub.add_parser(
        "pack-data",
        help="distilled data as compressed token arrays, to keep and carry instead of distilling again",
        description="Write the records of a finished `specformer distill` directory as compressed 16- or 32-bit "
        "token arrays in shards of at most --max-shard-mb; train, eval-drafter and eval_data read the result as "
        "they read the original.",
    )
    p.add_argument("data", type=Path, metavar="DIR", help="a finished `specformer distill` output directory")
    p.add_argument("--out", type=a.out_dir, required=True, metavar="DIR", help="new (or empty) output directory")
    p.add_argument("--max-shard-mb", type=a.kind(POSITIVE_INT), default=16, help="largest shard, MiB (default 16)")
    p.set_defaults(func=run_pack_data)
    _add_cache_states(sub)


def _add_cache_states(sub) -> None:
    p = sub.add_parser(
        "cache-states",
        help="run the target once over training data and keep the states a drafter reads, for `train --set states=`",
        description="Write the target's hidden states at the drafter's hooks over distilled data (bfloat16 shards "
        "and a manifest tying them to the target, the data and the hooks). A training run with `states: DIR` reads "
        "them instead of running the target at every step. Rerun the same command to resume an interrupted run.",
    )
    a.add_model(p)
    p.add_argument("--data", required=True, help="distilled training data (comma-separated directories, as `train`'s "
                   "data setting; the cache serves runs on exactly this data)")
    p.add_argument("--out", type=a.out_dir, required=True, metavar="DIR", help="the cache directory")
    p.add_argument("--seq-len", type=a.kind(POSITIVE_INT), default=512,
                   help="positions kept per record; serves runs with seq_len up to it (default 512)")
    p.add_argument("--hooks", type=a.int_list("--hooks", from_zero=True, like="0,15,29,30"), metavar="I,J,...",
                   help="hidden states to keep, each once, as a drafter's `hooks` setting (HF indexing from 0: 0 the "
                   "embeddings, L the final-normed output; default: the default drafter's, 0,L/2,L-1,L, which also "
                   "serve the kl objective)")
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=8)
    p.set_defaults(func=run_cache_states)


def run_sample_prompts(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.training.data.self_prompts import check_system, read_rounds, sample_prompts

    read_rounds(args.out)  # an unusable --out or --system fails before the model loads
    check_system(args.system)
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model)
    prompts = sample_prompts(model, args.num, args.out, seed=args.seed, temperature=args.temperature,
                             top_p=args.top_p, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             system=args.system)
    print(f"specformer: {len(prompts)} prompts in {args.out}", file=sys.stderr)
    return 0


def run_distill(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.encode import read_prompts_file
    from specformer_jax.training.data.distill import distill
    from specformer_jax.training.data.prompts import builtin_prompts

    if not args.prompts and not args.builtin_prompts:
        raise SpecformerError("give --prompts F.jsonl, --builtin-prompts N, or both")
    # Read the prompts before loading the model, so a bad prompts file fails at once.
    prompts = builtin_prompts(args.builtin_prompts or 0, args.seed)
    prompts += read_prompts_file(args.prompts) if args.prompts else []
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model)
    s = distill(model, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                chat=not args.no_chat, purpose="eval" if args.for_eval else "train")
    print(f"specformer: {s['num_prompts']} prompts distilled into {s['out_dir']} ({s['shards_written']} new "
          f"shard(s), {s['shards_skipped']} already done; {s['num_generated']} tokens at "
          f"{s['tokens_per_second']:.1f} tokens/s, {s['seconds']:.1f} s in all)", file=sys.stderr)
    return 0


def run_pack_data(args) -> int:
    from specformer_jax.training.data.packed import pack

    s = pack(args.data, args.out, args.max_shard_mb * 2**20)
    print(f"specformer: {s['records']} records ({s['tokens']:,} tokens) packed into {args.out}: {s['shards']} "
          f"shard(s), {s['bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    return 0


def run_cache_states(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.config import DrafterConfig
    from specformer_jax.training.data.dataset import check_token_ids, check_vocabulary, data_dirs, load_records
    from specformer_jax.training.state_cache import cache_states

    records = load_records(args.data, "--data")  # bad data fails before the model loads
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    target = load_target(args.model)
    check_vocabulary(data_dirs(args.data, "--data"), target.cfg.vocab_size)
    check_token_ids(records, target.cfg.vocab_size, args.data)
    hooks = tuple(args.hooks) if args.hooks is not None else DrafterConfig().resolved_hooks(target.cfg)
    s = cache_states(target, records, args.out, hooks=hooks, seq_len=args.seq_len, data=args.data,
                     batch_size=args.batch_size)
    rate = s["tokens"] / max(s["seconds"], 1e-9)
    print(f"specformer: states of {len(records)} records in {s['out']} ({s['shards_written']} new shard(s), "
          f"{s['shards_skipped']} already done; {s['tokens']:,} positions at {rate:.0f} a second); train with "
          f"--set states={s['out']}", file=sys.stderr)
    return 0
