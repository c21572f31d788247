"""`specformer train`, `eval-drafter`, `draft-vocab` and `average-drafters`: train a drafter on distilled data,
measure one, give a trained one a draft vocabulary, and average drafters of one shape."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specformer_jax.checks import NON_NEGATIVE_INT, POSITIVE_INT
from specformer_jax.cli import args as a
from specformer_jax.errors import SpecformerError


def add_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a SpecFormer drafter", description="Train a drafter on distilled data.")
    p.add_argument("--config", type=Path, help="YAML of TrainConfig settings (see configs/)")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override settings: --set steps=100 lr=3e-4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under `out`")
    multi = p.add_argument_group("several processes (default: SPECFORMER_* environment, SLURM or TPU pod detection)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (SPECFORMER_COORDINATOR)")
    multi.add_argument("--num-processes", type=a.kind(POSITIVE_INT), metavar="N",
                       help="processes in the run (SPECFORMER_NUM_PROCESSES)")
    multi.add_argument("--process-id", type=a.kind(NON_NEGATIVE_INT), metavar="I",
                       help="this process, 0..N-1 (SPECFORMER_PROCESS_ID)")
    p.set_defaults(func=run_train)

    p = sub.add_parser("eval-drafter", help="teacher-forced drafter accuracy on distilled data",
                       description="Per-slot top-1 accuracy and expected accepted length on held-out distilled data.")
    a.add_model(p)
    p.add_argument("--drafter", required=True,
                   help="a drafter directory (drafter.json + params.safetensors), or a shipped one "
                   f"('default', {a.SHIPPED_NAMES})")
    p.add_argument("--data", type=Path, required=True, help="a directory written by `specformer distill`")
    p.add_argument("--all", action="store_true",
                   help="score every record (default: only those held out by the drafter's training split; "
                   "every record of data distilled --for-eval)")
    p.add_argument("--seq-len", type=a.kind(POSITIVE_INT), default=512)
    p.add_argument("--batch-size", type=a.kind(POSITIVE_INT), default=8)
    p.add_argument("--draft-len", type=a.kind(POSITIVE_INT), metavar="K",
                   help="score only the first K slots, as decoding with K drafts (default: every slot)")
    p.add_argument("--save", action="store_true",
                   help="also store the result in the drafter's drafter.json (what --draft-len auto reads)")
    p.set_defaults(func=run_eval_drafter)

    p = sub.add_parser("draft-vocab", help="give a trained drafter a reduced draft vocabulary",
                       description="Copy a trained drafter with a draft vocabulary: the --size most frequent answer "
                       "tokens of --data. Its weights are unchanged (the head is the target's, cut to those rows), "
                       "so it drafts as before wherever its choice lies in the vocabulary, at a fraction of the "
                       "head's cost; output stays lossless. The weights are written in bfloat16, as `train` "
                       "writes them.")
    a.add_model(p)
    p.add_argument("--drafter", required=True,
                   help=f"a drafter directory, or a shipped one ('default', {a.SHIPPED_NAMES})")
    p.add_argument("--data", required=True, help="distilled training data whose answers choose the vocabulary "
                   "(comma-separated directories, as `train`'s data)")
    p.add_argument("--size", type=a.kind(POSITIVE_INT), required=True, metavar="V'",
                   help="tokens in the draft vocabulary, e.g. 8192")
    p.add_argument("--eval-data", help="distilled data to report the vocabulary's coverage on (dir1,dir2)")
    p.add_argument("--out", type=a.out_dir, required=True, help="the new drafter directory (must not hold a drafter)")
    p.set_defaults(func=run_draft_vocab)

    p = sub.add_parser("average-drafters", help="a drafter whose weights are the mean of several drafters'",
                       description="Write a drafter whose weights are the mean of --drafters' (one shape, one target: "
                       "e.g. a drafter and the one continued from it). Its draft vocabulary and settings are the "
                       "last drafter's. Measure it (eval-drafter --save) before using it: an average can accept "
                       "more than each drafter, or less.")
    a.add_model(p)
    p.add_argument("--drafters", required=True, metavar="A,B[,...]",
                   help=f"at least two drafter directories or shipped drafters ('default', {a.SHIPPED_NAMES})")
    p.add_argument("--out", type=a.out_dir, required=True, help="the new drafter directory (must not hold a drafter)")
    p.set_defaults(func=run_average_drafters)


def run_train(args) -> int:
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


def run_eval_drafter(args) -> int:
    from specformer_jax.checkpoints.drafter_io import record_eval
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import read_drafter
    from specformer_jax.files import probe_writable
    from specformer_jax.training.data.dataset import check_vocabulary, records_to_score
    from specformer_jax.training.evaluate import evaluate_drafter

    if args.save and args.draft_len is not None:
        raise SpecformerError("--save records every slot (what --draft-len auto reads): drop --draft-len")
    name = read_drafter(args.drafter).on(args.model).specformer("eval-drafter")
    if args.save and name.directory is None:
        raise SpecformerError("--save stores the result in the drafter's drafter.json: random weights have none")
    if args.save:
        probe_writable(name.directory / "drafter.json")  # a read-only drafter fails now, not after the evaluation
    target = load_target(args.model)
    drafter = name.load(target)
    check_vocabulary([args.data], target.cfg.vocab_size)  # evaluate_drafter checks the scored records' ids
    records = records_to_score(args.data, drafter.meta.get("train_config"), args.all)
    result = evaluate_drafter(target, drafter, records, seq_len=args.seq_len, batch_size=args.batch_size,
                              progress=True, draft_len=args.draft_len)
    json.dump(result, sys.stdout, indent=1)  # before saving: a save that fails loses nothing
    print()
    if args.save:
        try:
            saved = record_eval(name.directory, {**result, "data": str(args.data)})
        except OSError as e:
            where = f"{e.filename}: " if e.filename else ""
            raise SpecformerError(f"the result above was not saved ({where}{e.strerror or e})") from None
        print(f"specformer: saved to {saved} (what --draft-len auto reads)", file=sys.stderr)
    return 0


def run_draft_vocab(args) -> int:
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import read_drafter
    from specformer_jax.training.data.dataset import check_vocabulary, data_dirs

    if (args.out / "drafter.json").exists():
        raise SpecformerError(f"{args.out} already holds a drafter: choose a new --out")
    name = read_drafter(args.drafter).on(args.model).specformer("draft-vocab")
    if name.model == "random":
        raise SpecformerError("--drafter random has no trained weights to keep: give a trained drafter")
    data = data_dirs(args.data, "--data")
    if not data:
        raise SpecformerError("--data: give a directory written by `specformer distill` (several: dir1,dir2)")
    target = load_target(args.model)
    if args.size >= target.cfg.vocab_size:
        raise SpecformerError(f"--size {args.size} must be smaller than the target's vocabulary "
                              f"({target.cfg.vocab_size} tokens)")
    check_vocabulary(data + data_dirs(args.eval_data, "--eval-data"), target.cfg.vocab_size)
    drafter = name.load(target)
    meta = _write_draft_vocab(args, target, drafter)
    cover = f"{meta['coverage_train']:.1%} of --data's answer tokens" + (
        f", {meta['coverage_eval']:.1%} of --eval-data's" if meta["coverage_eval"] is not None else "")
    print(f"specformer: {args.out}: the drafter with a draft vocabulary of {args.size} tokens covering {cover}; "
          "its acceptance changed, so measure it again (eval-drafter --save, what --draft-len auto reads)",
          file=sys.stderr)
    return 0


def _write_draft_vocab(args, target, drafter) -> dict:
    """Write the drafter copy with the vocabulary of --data's answers (the records its own training would use: the
    held-out split of the drafter's eval_fraction left out); returns drafter.json's "draft_vocab"."""
    import dataclasses

    from specformer_jax.checkpoints.drafter_io import file_meta, save_drafter
    from specformer_jax.training.data.dataset import check_token_ids, load_records, split
    from specformer_jax.training.data.draft_vocab import answer_token_counts, draft_vocabulary, vocab_meta

    size = target.cfg.vocab_size
    records = load_records(args.data, "--data")
    fraction = (drafter.meta.get("train_config") or {}).get("eval_fraction")
    records = split(records, fraction)[0] if fraction else records
    evals = load_records(args.eval_data, "--eval-data", for_training=False) if args.eval_data else []
    for recs, where in ((records, "--data"), (evals, "--eval-data")):
        check_token_ids(recs, size, where)
    counts = answer_token_counts(records, size)
    if not counts.sum():
        raise SpecformerError("--data holds no answer tokens to choose a draft vocabulary from")
    vocab = draft_vocabulary(counts, args.size)
    meta = vocab_meta(counts, vocab, answer_token_counts(evals, size) if evals else None) | {
        "data": args.data, "made_from": str(args.drafter), "made_from_sha256": drafter.sha256}
    save_drafter(args.out, dataclasses.replace(drafter.cfg, draft_vocab_size=args.size),
                 drafter.params.replace(vocab=vocab), target.cfg, meta=file_meta(drafter.meta), vocab_meta=meta)
    return meta


def run_average_drafters(args) -> int:
    from specformer_jax.checkpoints.drafter_io import VOCAB_KEY, file_meta, save_drafter
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.names import read_drafter
    from specformer_jax.training.averaging import average_drafters

    if (args.out / "drafter.json").exists():
        raise SpecformerError(f"{args.out} already holds a drafter: choose a new --out")
    texts = [text.strip() for text in args.drafters.split(",") if text.strip()]
    if len(texts) < 2:
        raise SpecformerError(f"--drafters: give at least two drafters, comma-separated (got {len(texts)})")
    names = [read_drafter(text).on(args.model).specformer("average-drafters") for text in texts]
    if any(name.model == "random" for name in names):
        raise SpecformerError("--drafters: random has no trained weights to average: give trained drafters")
    target = load_target(args.model)
    drafters = [name.load(target) for name in names]
    cfg, params = average_drafters(drafters)
    last = drafters[-1]
    sources = [{"drafter": name.text, "sha256": d.sha256} for name, d in zip(names, drafters)]
    save_drafter(args.out, cfg, params, target.cfg, meta={**file_meta(last.meta), "averaged_from": sources},
                 vocab_meta=last.meta.get(VOCAB_KEY))
    print(f"specformer: {args.out}: the mean of {len(names)} drafters, with the last one's draft vocabulary; "
          "measure it (eval-drafter --save, what --draft-len auto reads)", file=sys.stderr)
    return 0
