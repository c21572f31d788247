"""The `specformer` command."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from specformer_jax.errors import SpecformerError
from specformer_jax.files import write_atomic, write_json


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind, ok, what: str):
    """An argparse type: `kind`(s), refused with "expected <what>" unless ok(value)."""

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not ok(v):  # NaN fails every bound
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v

    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_positive_float = _number(float, lambda v: v > 0, "a positive number")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_seed = _number(int, lambda v: -2**63 <= v < 2**63, "an integer that fits in 64 bits")


def _nonneg(kind):
    return _number(kind, lambda v: v >= 0, "a non-negative number")


def _out_file(s: str) -> Path:
    """An output file's path, refused before any work when it could not be written: a directory, or under a file."""
    path = Path(s)
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{s} exists and is not a file")
    return _writable(s, path)


def _out_dir(s: str) -> Path:
    """An output directory's path, refused before any work when it could not be made or written."""
    path = Path(s)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{s} exists and is not a directory")
    return _writable(s, path)


def _writable(s: str, path: Path) -> Path:
    parent = next((a for a in path.absolute().parents if a.exists()), None)
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{s} lies under {parent}, which is a file")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{s}: permission denied (cannot write {path if path.exists() else parent})")
    return path


def _draft_len(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        return _nonneg(int)(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or auto, got {s!r}") from None


def read_prompts_file(path):
    from specformer_jax.decoding.encode import read_prompts_file as read

    return read(path)


def _add_attention_impl(p):
    from pallas_kernels import IMPLS

    p.add_argument("--attention-impl", choices=IMPLS, default="auto",
                   help="attention kernels: auto = Pallas on GPU/TPU, the jnp reference on CPU")
    p.add_argument("--mesh", default=None,
                   help="shard decoding over devices, e.g. data=4,tensor=2 (rows over data, the model over tensor)")


def _mesh(args):
    from specformer_jax.parallel import make_mesh

    return make_mesh(args.mesh) if args.mesh else None


def _records():
    from specformer_jax.decoding.records import DecodeRecords

    return DecodeRecords.default()


def _add_model(p):
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a HF checkpoint dir or a .gguf file")


def _add_generate(sub):
    p = sub.add_parser("generate", help="decode prompts with a target model", description="Decode prompts on the device.")
    _add_model(p)
    p.add_argument("--prompt", action="extend", nargs="+", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, help='JSONL with {"prompt": ...} or {"input_ids": [...]} per line')
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=_nonneg(float), default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=_probability, default=1.0)
    p.add_argument("--top-k", type=_nonneg(int), default=0, help="0 = off")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--max-cache-len", type=_positive_int, default=None, help="default: the model's context length")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: checkpoint dtype (GGUF: float32)")
    _add_attention_impl(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--json", action="store_true", help="print one JSON document with results and stats")
    p.add_argument("--drafter", default=None,
                   help="'default' (shipped for the default model), a drafter directory, or 'none' for plain decoding; "
                        "default: the shipped drafter when --model is default, else none")
    p.add_argument("--draft-len", type=_draft_len, default=None,
                   help="drafts per round: 1..trained slots, 0 = off, or auto (chosen per batch size from measured "
                        "costs; default: all trained slots on a GPU/TPU, 1 on a CPU)")
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
    model = load_target(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    drafter = _choose_drafter(args, model)
    if args.max_cache_len and args.max_cache_len > model.cfg.max_position:
        print(f"specformer: warning: --max-cache-len {args.max_cache_len} is past the model's context length "
              f"({model.cfg.max_position}): positions beyond it were never trained", file=sys.stderr)
    if drafter is None and args.draft_len not in (None, 0):
        raise SpecformerError(f"--draft-len {args.draft_len} needs a drafter: pass --drafter DIR (this run decodes "
                              "plainly)")
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
        drafter=drafter,
        draft_len=args.draft_len,
        mesh=_mesh(args),
        records=_records(),
    )
    result.stats["load_seconds"] = load_s
    result.stats["drafter"] = (args.drafter or "default") if drafter is not None else "none"
    s = result.stats
    spec = (f", drafter {s['drafter']}, k = {s['draft_len']}, mean accepted length {s['mean_accepted_length']:.2f}"
            if "mean_accepted_length" in s else ", plain decoding")
    print(
        f"specformer: {s['num_generated']} tokens in {s['run_seconds']:.2f} s = {s['tokens_per_second']:.1f} tokens/s "
        f"(batch {s['batch_size']}, {s['device']}, {s['dtype']}{spec}; compile {s['compile_seconds']:.1f} s, "
        f"load {load_s:.1f} s)",
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


def _choose_drafter(args, model):
    """The drafter to decode with, or None for plain AR decoding."""
    from specformer_jax.checkpoints.drafter_io import DEFAULT_DRAFTER, load_drafter

    choice = args.drafter
    if choice is None:  # implicit: the shipped drafter goes with the default model
        if args.model != "default" or not (DEFAULT_DRAFTER / "drafter.json").is_file():
            return None
        choice = "default"
    if choice == "none":
        return None
    return load_drafter(choice, model)


def _add_distill(sub):
    p = sub.add_parser(
        "distill",
        help="write the target's greedy answers to prompts as drafter training data",
        description="Self-distillation: greedy-decode training prompts with the target and write them as resumable "
        "JSONL shards. Rerun the same command to resume an interrupted run.",
    )
    _add_model(p)
    p.add_argument("--prompts", type=Path, metavar="F.jsonl",
                   help='JSONL with {"prompt": ...} or {"input_ids": [...]} per line (e.g. from sample-prompts)')
    p.add_argument("--builtin-prompts", type=_positive_int, metavar="N",
                   help="N prompts from the built-in set (before those of --prompts when both are given)")
    p.add_argument("--out", type=_out_dir, required=True, metavar="DIR", help="output directory (shards and manifest.json)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--batch-size", type=_positive_int, default=16)
    p.add_argument("--seed", type=_seed, default=0, help="seed of --builtin-prompts")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    p.add_argument("--for-eval", action="store_true",
                   help="data to measure drafters on (a training run's eval_data, eval-drafter): evaluation prompts "
                   "such as benchmarks/prompts.jsonl are allowed, and `specformer train` refuses it as training data")
    p.set_defaults(func=_run_distill)


def _run_distill(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.training.distill import distill
    from specformer_jax.training.prompts import builtin_prompts

    if not args.prompts and not args.builtin_prompts:
        raise SpecformerError("give --prompts F.jsonl, --builtin-prompts N, or both")
    # Read the prompts before loading the model, so a bad prompts file fails at once.
    prompts = builtin_prompts(args.builtin_prompts or 0, args.seed)
    prompts += read_prompts_file(args.prompts) if args.prompts else []
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model)
    s = distill(
        model, prompts, args.out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, chat=not args.no_chat,
        purpose="eval" if args.for_eval else "train",
    )
    print(
        f"specformer: {s['num_prompts']} prompts distilled into {s['out_dir']} ({s['shards_written']} new shard(s), "
        f"{s['shards_skipped']} already done; {s['num_generated']} tokens at {s['tokens_per_second']:.1f} tokens/s, "
        f"{s['seconds']:.1f} s in all)",
        file=sys.stderr,
    )
    return 0


def _add_sample_prompts(sub):
    p = sub.add_parser(
        "sample-prompts",
        help="sample training prompts from the model itself (user requests it writes)",
        description="Prompt the model with its chat template up to a user turn and sample what the user says: distinct "
        "finished requests, written to a JSONL file for `specformer distill --prompts`. Rerun to resume or extend.",
    )
    _add_model(p)
    p.add_argument("--num", type=_positive_int, required=True, metavar="N", help="number of distinct prompts")
    p.add_argument("--out", type=_out_file, required=True, metavar="F.jsonl")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--temperature", type=_positive_float, default=1.0)
    p.add_argument("--top-p", type=_probability, default=0.95)
    p.add_argument("--max-new-tokens", type=_positive_int, default=96, help="longer requests are dropped")
    p.add_argument("--batch-size", type=_positive_int, default=256)
    p.set_defaults(func=_run_sample_prompts)


def _run_sample_prompts(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.training.self_prompts import read_rounds, sample_prompts

    read_rounds(args.out)  # an unusable --out fails before the model loads
    print(f"specformer: loading {args.model} ...", file=sys.stderr)
    model = load_target(args.model)
    prompts = sample_prompts(model, args.num, args.out, seed=args.seed, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    print(f"specformer: {len(prompts)} prompts in {args.out}", file=sys.stderr)
    return 0


def _add_train(sub):
    p = sub.add_parser("train", help="train a SpecFormer drafter", description="Train a drafter on distilled data.")
    p.add_argument("--config", type=Path, help="YAML of TrainConfig settings (see configs/)")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override settings: --set steps=100 lr=3e-4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under `out`")
    multi = p.add_argument_group("several processes (default: SPECFORMER_* environment, SLURM or TPU pod detection)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (SPECFORMER_COORDINATOR)")
    multi.add_argument("--num-processes", type=_positive_int, metavar="N",
                       help="processes in the run (SPECFORMER_NUM_PROCESSES)")
    multi.add_argument("--process-id", type=_nonneg(int), metavar="I", help="this process, 0..N-1 (SPECFORMER_PROCESS_ID)")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from specformer_jax.distributed import initialize_distributed
    from specformer_jax.training.train_config import load_train_config
    from specformer_jax.training.trainer import train

    cfg = load_train_config(args.config, args.set)  # touches no device: a bad config fails before waiting for peers
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)  # before any JAX device use
    result = train(cfg, resume=args.resume)
    ev = result["eval"]
    summary = f"; eval expected accepted length {ev['expected_accepted_length']:.3f}" if ev else ""
    print(f"specformer: trained to step {result['step']}{summary}; drafter in {Path(cfg.out) / 'drafter'}",
          file=sys.stderr)
    return 0


def _add_eval_drafter(sub):
    p = sub.add_parser("eval-drafter", help="teacher-forced drafter accuracy on distilled data",
                       description="Per-slot top-1 accuracy and expected accepted length on held-out distilled data.")
    _add_model(p)
    p.add_argument("--drafter", required=True, help="a drafter directory (drafter.json + params.safetensors)")
    p.add_argument("--data", type=Path, required=True, help="a directory written by `specformer distill`")
    p.add_argument("--all", action="store_true",
                   help="score every record (default: only those held out by the drafter's training split; "
                   "every record of data distilled --for-eval)")
    p.add_argument("--seq-len", type=_positive_int, default=512)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--save", action="store_true",
                   help="also store the result in the drafter's drafter.json (what --draft-len auto reads)")
    p.set_defaults(func=_run_eval_drafter)


def _run_eval_drafter(args) -> int:
    from specformer_jax.checkpoints.drafter_io import load_drafter, record_eval
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.training.data import is_eval_record
    from specformer_jax.training.distill import check_vocabulary, manifest_setting, read_distilled, read_manifest
    from specformer_jax.training.evaluate import evaluate_drafter

    target = load_target(args.model)
    drafter = load_drafter(args.drafter, target)
    records = read_distilled(args.data)
    check_vocabulary([args.data], target.cfg.vocab_size)  # evaluate_drafter checks the scored records' ids
    if not args.all and manifest_setting(read_manifest(args.data), "purpose") != "eval":  # unseen data: score all
        fraction = drafter.meta.get("train_config", {}).get("eval_fraction")
        if fraction is None:
            raise SpecformerError("the drafter records no training split: pass --all to score every record")
        records = [r for r in records if is_eval_record(r["index"], fraction)]
    if not records:
        raise SpecformerError(f"no records to score in {args.data}")
    result = evaluate_drafter(target, drafter, records, seq_len=args.seq_len, batch_size=args.batch_size, progress=True)
    if args.save:
        saved = record_eval(args.drafter, {**result, "data": str(args.data)})
        print(f"specformer: saved to {saved} (what --draft-len auto reads)", file=sys.stderr)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


def _add_bench(sub):
    p = sub.add_parser("bench", help="AR vs speculative decoding throughput per batch size",
                       description="Plain and speculative decoding of the same prompts, in one process.")
    _add_model(p)
    p.add_argument("--drafter", default="default", help="'default', a drafter directory, or 'none' (AR only)")
    p.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parents[1] / "benchmarks" / "prompts.jsonl",
                   help="JSONL prompts (default: benchmarks/prompts.jsonl)")
    p.add_argument("--batch-sizes", type=_int_list("--batch-sizes"), default=[1, 8],
                   help="comma-separated, e.g. 1,4,16,64")
    p.add_argument("--draft-len", type=_draft_len, default=None,
                   help="drafts per round, or auto (per batch size; default: all trained slots on a GPU/TPU, 1 on a CPU)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed runs of each side, alternating plain and speculative; medians reported (default 3)")
    _add_attention_impl(p)
    p.add_argument("--out", type=_out_file, required=True, help="result JSON")
    p.add_argument("--plot", type=_out_file, help="also draw tokens/s per batch size to this PNG")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from specformer_jax.bench.plot import plot_bench
    from specformer_jax.bench.run import run_benchmark
    from specformer_jax.checkpoints.drafter_io import load_drafter
    from specformer_jax.checkpoints.loader import load_target

    model = load_target(args.model, attention_impl=args.attention_impl)
    drafter = None if args.drafter == "none" else load_drafter(args.drafter, model)
    if drafter is None and args.draft_len not in (None, 0):
        raise SpecformerError(f"--draft-len {args.draft_len} needs a drafter; --drafter none times plain decoding only")
    prompts = read_prompts_file(args.prompts)
    head = {"command": "specformer " + shlex.join(args.argv), "model": args.model, "drafter": args.drafter}
    # written after every batch size, so an interrupted run keeps the batch sizes it finished
    result = run_benchmark(model, drafter, prompts, batch_sizes=args.batch_sizes, draft_len=args.draft_len,
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats, mesh=_mesh(args),
                           records=_records(),
                           on_progress=lambda doc: write_json(args.out, {**head, **doc}))
    result = {**head, **result}
    if args.plot:
        plot_bench(result, args.plot)
    print(f"specformer: wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0


def _int_list(name):
    def parse(s: str) -> list[int]:
        try:
            values = [int(x) for x in s.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{name} expects positive integers like 1,8,64, got {s!r}")
        return values

    return parse


def _add_bench_kernels(sub):
    from pallas_kernels import IMPLS

    p = sub.add_parser("bench-kernels", help="Pallas attention kernel vs the XLA reference at verify shapes",
                       description="Time the ragged attention kernel against the jnp/XLA reference, with achieved "
                                   "memory bandwidth against the measured read bandwidth.")
    p.add_argument("--batch-sizes", type=_int_list("--batch-sizes"), default=[1, 8, 64])
    p.add_argument("--queries", type=_int_list("--queries"), default=[5, 9], help="new tokens per row (k + 1)")
    p.add_argument("--cache-lens", type=_int_list("--cache-lens"), default=[1024, 4096, 8192])
    p.add_argument("--heads", type=_positive_int, default=32)
    p.add_argument("--kv-heads", type=_positive_int, default=8)
    p.add_argument("--head-dim", type=_positive_int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--impl", choices=IMPLS, default="pallas", help="the kernel side (interpret: a CPU smoke run)")
    p.add_argument("--repeats", type=_positive_int, default=20)
    p.add_argument("--chain", type=_positive_int, default=1,
                   help="time N dependent calls in one jitted call and divide by N, so per-call dispatch drops out")
    p.add_argument("--out", type=_out_file, required=True, help="result JSON")
    p.set_defaults(func=_run_bench_kernels)


def _run_bench_kernels(args) -> int:
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


def _add_report(sub):
    p = sub.add_parser("report", help="bench result files side by side with roofline estimates",
                       description="Lay `specformer bench` result files (any devices) side by side, each held against "
                                   "a roofline estimate of plain and speculative decoding.")
    p.add_argument("results", nargs="+", type=Path, help="result JSON files from `specformer bench`")
    p.add_argument("--out", type=_out_file, required=True, help="Markdown report")
    p.add_argument("--plot", type=_out_file, help="also draw measured and roofline speedup per batch size to this PNG")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from specformer_jax.bench.report import load_results, plot_report, render_markdown

    docs = load_results(args.results)
    write_atomic(args.out, render_markdown(docs) + "\n")
    if args.plot:
        plot_report(docs, args.plot)
    print(f"specformer: wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specformer", description="SpecFormer speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_sample_prompts(sub)
    _add_distill(sub)
    _add_train(sub)
    _add_eval_drafter(sub)
    _add_bench(sub)
    _add_bench_kernels(sub)
    _add_report(sub)
    return parser


def _persistent_compile_cache() -> None:
    """Keep XLA's compiled programs across runs, under SPECFORMER_CACHE/xla, so a second `generate` or `bench` skips
    most of the compilation (seconds on a CPU, tens of seconds per decoding loop on a GPU). A cache directory set
    through JAX (JAX_COMPILATION_CACHE_DIR) is kept; JAX_ENABLE_COMPILATION_CACHE=false turns caching off."""
    import jax

    from specformer_jax.checkpoints.default import cache_dir

    if jax.config.jax_enable_compilation_cache and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in result files
    try:
        _persistent_compile_cache()
        return args.func(args)
    except SpecformerError as e:
        print(f"specformer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the OS refused (permissions, a file where a directory goes, a full disk)
        where = f"{e.filename}: " if e.filename else ""
        print(f"specformer: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specformer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
