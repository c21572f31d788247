"""`train`: a drafter training run in four stages. prepare (data, checks, target, mesh, jitted steps), restore (fresh
or from the latest checkpoint), loop (steps, logging, periodic eval, checkpoints, Ctrl-C), export (the drafter).

The step is jitted with explicit shardings over the mesh; optax AdamW with warm-up and cosine decay; orbax checkpoints
also hold the data iterator's position, so a resumed run sees exactly the batches an uninterrupted run would."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from tqdm import tqdm

from specformer_jax.checkpoints.drafter_io import save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.names import read_drafter
from specformer_jax.errors import SpecformerError
from specformer_jax.files import append_line, probe_writable, write_json
from specformer_jax.modeling.drafter import DrafterParams, drafter_axes, drafter_shapes, init_drafter
from specformer_jax.modeling.loaded import LoadedTarget
from specformer_jax.modeling.target import target_axes
from specformer_jax.parallel import (
    barrier,
    batch_sharded,
    make_mesh,
    param_shardings,
    put_global,
    put_process_batch,
    replicated,
    to_host,
)
from specformer_jax.training.data.batches import eval_batches, training_batches
from specformer_jax.training.data.dataset import (
    check_scorable,
    check_token_ids,
    check_vocabulary,
    data_dirs,
    load_records,
    split,
)
from specformer_jax.training.data.draft_vocab import answer_token_counts, draft_vocabulary, vocab_meta
from specformer_jax.training.loss import drafter_loss, hooks_read, metrics_from_sums
from specformer_jax.training.plots import plot_training
from specformer_jax.training.state_cache import open_caches
from specformer_jax.training.train_config import DRAFTER_SETTINGS, TrainConfig


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict  # the drafter's weights (DrafterParams.weights): what the optimizer moves
    opt_state: optax.OptState


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.min_lr)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.999, eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
    )


def train_shardings(target: LoadedTarget, cfg: TrainConfig, tx, mesh):
    """(train state shardings, target parameter shardings) on `mesh`, from the logical axes each weight declares
    (see specformer_jax.parallel): the optimizer state's copies of the weights are sharded like the weights."""
    weights = drafter_shapes(target.cfg, cfg.drafter).weights
    weight_sh = param_shardings(weights, drafter_axes(target.cfg, cfg.drafter).weights, mesh)
    opt_sh = optax.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, weights), weight_sh,
                                   transform_non_params=lambda _: replicated(mesh))
    target_sh = param_shardings(target.params, target_axes(target.cfg), mesh)
    return TrainState(replicated(mesh), weight_sh, opt_sh), target_sh


def make_steps(target: LoadedTarget, cfg: TrainConfig, tx, mesh, vocab: np.ndarray | None = None):
    """(train_step, eval_step), jitted with explicit shardings: batches over the batch axes, the frozen target and
    the drafter's parameters and optimizer state by the logical-axis rules (FSDP and tensor parallel). vocab: the
    run's draft vocabulary (numpy: a constant of both steps), or None."""
    drafter_loss_fn = jax.tree_util.Partial(drafter_loss, target_cfg=target.cfg, drafter_cfg=cfg.drafter,
                                            chunk_positions=cfg.chunk_positions, objective=cfg.objective,
                                            slot_decay=cfg.slot_loss_decay, reach=cfg.slot_loss_reach)
    loss_fn = lambda weights, *args, **kw: drafter_loss_fn(DrafterParams(weights, vocab), *args, **kw)

    def train_step(state: TrainState, target_params, batch):
        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, target_params, batch["tokens"], batch["label_mask"], states=batch.get("states")
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        out = {"loss": loss, "grad_norm": optax.tree.norm(grads), **metrics_from_sums(sums)}
        return TrainState(state.step + 1, params, opt_state), out

    def eval_step(params, target_params, batch):
        return loss_fn(params, target_params, batch["tokens"], batch["label_mask"], replay=True)[1]

    rep, data = replicated(mesh), batch_sharded(mesh)
    state_sh, target_sh = train_shardings(target, cfg, tx, mesh)
    train = jax.jit(train_step, in_shardings=(state_sh, target_sh, data), out_shardings=(state_sh, rep),
                    donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(state_sh.params, target_sh, data), out_shardings=rep)
    return train, evaluate


def _summaries(sums_list) -> dict:
    total = jax.tree.map(lambda *x: sum(x), *sums_list)
    m = metrics_from_sums(total)
    return {"loss": float(jnp.mean(m["loss_per_slot"])), **{k: np.asarray(v).tolist() for k, v in m.items()}}


def _answer_tokens(host_batch: dict, placed: dict) -> int:
    """Answer tokens in the global batch (with several processes, `host_batch` holds only this process's rows)."""
    if jax.process_count() == 1:
        return int(host_batch["label_mask"].sum())
    return int(jnp.sum(placed["label_mask"]))


def _logged_eval_steps(metrics: Path) -> set[int]:
    """Steps whose eval metrics.jsonl already holds (a line cut by a crash is skipped)."""
    steps = set()
    for line in metrics.read_text().splitlines() if metrics.is_file() else ():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("split") == "eval":
            steps.add(record["step"])
    return steps


def _check_resumable(out: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a run whose checkpoints hold another drafter than these settings make."""
    try:
        saved = json.loads((out / "train_config.json").read_text())
    except (OSError, ValueError):
        return  # nothing readable to compare with: the restore itself checks shapes
    mine = cfg.settings()
    as_set = lambda v: tuple(v) if isinstance(v, list) else v  # JSON keeps hooks as a list
    diff = [f"{k}={saved[k]!r} (now {mine[k]!r})" for k in DRAFTER_SETTINGS
            if isinstance(saved, dict) and k in saved and as_set(saved[k]) != mine[k]]
    if diff:
        raise SpecformerError(f"--resume: {out} was trained with {', '.join(diff)}; resume with its drafter "
                              "settings, or choose another out")
    if isinstance(saved, dict) and saved.get("model", cfg.model) != cfg.model:  # a moved checkpoint is fine
        print(f"specformer: warning: {out} was trained on model {saved['model']}, resuming with {cfg.model}",
              file=sys.stderr)


TOKEN_INPUTS = ("next_token_input", "context_token_input")


def initial_params(cfg: TrainConfig, target: LoadedTarget) -> dict:
    """Random drafter weights, or those of the drafter `init_from` names (a directory, or "default": names.py; the run
    makes its own draft vocabulary from its data). Its settings must be the run's, except that a run may add token
    inputs (next_token_input, context_token_input) to a drafter without them: each new input starts at zero, so the
    run continues exactly where that drafter stands."""
    fresh = lambda: init_drafter(target.cfg, cfg.drafter, jax.random.key(cfg.seed)).weights
    if cfg.init_from is None:
        return fresh()
    start = read_drafter(cfg.init_from).specformer("init_from").load(target)
    weights = start.params.weights
    same = dataclasses.replace(start.cfg, draft_vocab_size=cfg.drafter.draft_vocab_size)  # weights do not depend on it
    added = {name: False for name in TOKEN_INPUTS if getattr(cfg.drafter, name) and not getattr(start.cfg, name)}
    if same != dataclasses.replace(cfg.drafter, **added):
        raise SpecformerError(f"init_from {cfg.init_from}: its drafter settings {start.cfg} differ from this run's "
                              f"{cfg.drafter}")
    if not added:
        return weights
    new = fresh()
    grown = {**new, **weights}
    if "context_token_input" in added:  # the fuse reads the token's embedding last: zero rows for it
        kernel = weights["fuse"]["kernel"]
        grown["fuse"] = {"kernel": jnp.zeros_like(new["fuse"]["kernel"]).at[: kernel.shape[0]].set(kernel)}
    return grown


@dataclasses.dataclass
class _Run:
    """A prepared run: everything the stages after `_prepare` share."""

    cfg: TrainConfig
    out: Path
    target: LoadedTarget  # parameters placed on the mesh
    mesh: object
    tx: optax.GradientTransformation
    start: dict  # the drafter's parameters to start from (init_from or random)
    vocab: np.ndarray | None  # the draft vocabulary (draft_vocab_size), from the training records
    vocab_meta: dict  # its size and coverage of the training and evaluation answers (drafter.json "draft_vocab")
    state_shardings: TrainState
    train_step: Callable
    eval_step: Callable
    data: object  # the grain iterator over this process's share of the training batches
    evals: list[dict]  # fixed evaluation batches (none: no periodic eval)
    manager: ocp.CheckpointManager
    is_main: bool  # process 0: writes metrics, plots and the drafter

    def save(self, step: int, state: TrainState, data_state) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state)))
        self.manager.wait_until_finished()

    def log(self, record: dict) -> None:
        if self.is_main:
            append_line(self.out / "metrics.jsonl", json.dumps(record))

    def evaluate(self, state: TrainState, step: int, unless_logged: bool = False) -> dict:
        """The periodic eval at `step`: logged, shown and plotted (unless_logged: not again when already logged)."""
        if not self.evals:
            return {}
        batches = [put_global(b, batch_sharded(self.mesh)) for b in self.evals]
        m = _summaries([self.eval_step(state.params, self.target.params, b) for b in batches])
        if unless_logged and self.is_main and step in _logged_eval_steps(self.out / "metrics.jsonl"):
            return m
        self.log({"split": "eval", "step": step, **m})
        if self.is_main:
            acc = " ".join(f"{a:.3f}" for a in m["accuracy_per_slot"])
            tqdm.write(f"eval step {step}: loss {m['loss']:.4f}, accuracy per slot [{acc}], "
                       f"expected accepted length {m['expected_accepted_length']:.3f} (in decoding "
                       f"{m['decoding_accepted_length']:.3f})")
            plot_training(self.out / "metrics.jsonl", self.out / "training_curve.png")  # the curve so far, mid-run
        return m


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) a training run; everything goes under cfg.out, the drafter to cfg.out/drafter. Returns
    {"step": the last step, "eval": the last eval's metrics, "state": the final TrainState}."""
    run = _prepare(cfg, resume)
    state = _restore(run, resume, progress)
    state, last_eval = _loop(run, state, resume, progress)
    return _export(run, state, last_eval)


def _prepared_data(cfg: TrainConfig, out: Path, resume: bool) -> tuple[list[dict], list[dict], list[dict]]:
    """(every record of `data`, the training records, the evaluation records), checked against the settings before
    anything heavy happens."""
    ckpt_dir = out / "checkpoints"
    if out.exists() and not out.is_dir():
        raise SpecformerError(f"out {cfg.out} exists and is not a directory")
    probe_writable(out, directory=True)  # an out the OS refuses fails now, not after the target loads
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()) and not resume:
        raise SpecformerError(f"{out} already has checkpoints: pass --resume to continue, or choose another out")
    if resume and not (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())):
        raise SpecformerError(f"--resume: no checkpoint under {ckpt_dir}")
    records = load_records(cfg.data)
    if cfg.states is not None:  # each record's place in the data: where its states lie in the cache
        records = [{**r, "position": i} for i, r in enumerate(records)]
    train_recs, held_out = split(records, cfg.eval_fraction)
    eval_recs = held_out if cfg.eval_data is None else load_records(cfg.eval_data, "eval_data", for_training=False)
    if train_recs and all(r["prompt_len"] >= cfg.seq_len for r in train_recs):
        raise SpecformerError(f"seq_len {cfg.seq_len} leaves no answer token to learn from: every training prompt is "
                              "at least that long")
    if len(train_recs) < cfg.batch_size:
        raise SpecformerError(f"only {len(train_recs)} training sequences for batch_size {cfg.batch_size}")
    if cfg.batch_size % jax.process_count():
        raise SpecformerError(f"batch_size {cfg.batch_size} must be a multiple of the {jax.process_count()} processes")
    scored = eval_recs[: cfg.batch_size * cfg.eval_batches]  # what the periodic eval scores (eval_batches)
    if scored:
        check_scorable(scored, cfg.seq_len, cfg.drafter.num_slots,
                       f"the periodic eval's data ({cfg.eval_data or 'held out'})")
    if resume:
        _check_resumable(out, cfg)
    return records, train_recs, eval_recs


def _prepare(cfg: TrainConfig, resume: bool) -> _Run:
    """Data, checks, the target on the mesh, the jitted steps and the checkpoint manager."""
    if not isinstance(cfg, TrainConfig):
        raise SpecformerError("cfg must be a TrainConfig (load_train_config(path, overrides)), "
                              f"got {type(cfg).__name__}")
    out = Path(cfg.out).absolute()
    records, train_recs, eval_recs = _prepared_data(cfg, out, resume)
    if cfg.init_from is not None:  # a drafter that is not there fails now, not after the target loads
        read_drafter(cfg.init_from).on(cfg.model).specformer("init_from")
    target = load_target(cfg.model, attention_impl=cfg.attention_impl)
    check_vocabulary(data_dirs(cfg.data) + data_dirs(cfg.eval_data, "eval_data"), target.cfg.vocab_size)
    check_token_ids(records, target.cfg.vocab_size, cfg.data)
    if cfg.eval_data is not None:
        check_token_ids(eval_recs, target.cfg.vocab_size, cfg.eval_data)
    states = None if cfg.states is None else open_caches(
        cfg.states, target, records, hooks_read(target.cfg, cfg.drafter, cfg.objective), cfg.seq_len)
    start = initial_params(cfg, target)  # a bad init_from fails here, before anything is written
    vocab, vocab_meta = _draft_vocab(cfg, target, train_recs, eval_recs, resume)
    mesh, tx = make_mesh(cfg.mesh), make_optimizer(cfg)
    train_step, eval_step = make_steps(target, cfg, tx, mesh, vocab)
    data = iter(training_batches(train_recs, seq_len=cfg.seq_len, batch_size=cfg.batch_size, steps=cfg.steps,
                                 seed=cfg.seed, process_index=jax.process_index(), process_count=jax.process_count(),
                                 states=states))
    evals = eval_batches(eval_recs, seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_batches=cfg.eval_batches)
    state_sh, target_sh = train_shardings(target, cfg, tx, mesh)
    target = dataclasses.replace(target, params=put_global(target.params, target_sh))
    barrier("specformer-train-checked-out-dir")  # every process has checked `out` before any writes to it
    # Every process takes part in checkpoint saves and restores (each writes its own shards; orbax coordinates).
    manager = ocp.CheckpointManager(out / "checkpoints", options=ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep_checkpoints, create=True))
    return _Run(cfg, out, target, mesh, tx, start, vocab, vocab_meta, state_sh, train_step, eval_step, data, evals,
                manager, jax.process_index() == 0)


def _draft_vocab(cfg: TrainConfig, target: LoadedTarget, train_recs, eval_recs,
                 resume: bool) -> tuple[np.ndarray | None, dict]:
    """The run's draft vocabulary (the same on every process: a function of the training records; on resume, the
    one the run was trained with or an error) and what it covers; (None, {}) without draft_vocab_size."""
    if cfg.drafter.draft_vocab_size is None:
        return None, {}
    counts = answer_token_counts(train_recs, target.cfg.vocab_size)
    vocab = draft_vocabulary(counts, cfg.drafter.draft_vocab_size)
    if resume:
        _check_same_vocab(Path(cfg.out).absolute() / VOCAB_FILE, vocab)
    eval_counts = answer_token_counts(eval_recs, target.cfg.vocab_size) if eval_recs else None
    meta = vocab_meta(counts, vocab, eval_counts)
    if jax.process_index() == 0:
        print(f"specformer: draft vocabulary of {vocab.size} tokens covers {meta['coverage_train']:.1%} of the "
              "training answer tokens" + (f", {meta['coverage_eval']:.1%} of the evaluation ones" if eval_recs
                                         else ""), file=sys.stderr)
    return vocab, meta


VOCAB_FILE = "draft_vocab.json"  # the run's draft vocabulary, kept beside its checkpoints


def _check_same_vocab(path: Path, vocab: np.ndarray) -> None:
    """Refuse to resume with a draft vocabulary other than the one the checkpoints were trained with (data changed)."""
    if path.is_file() and json.loads(path.read_text()) != vocab.tolist():
        raise SpecformerError(f"{path.parent}: the training data now makes another draft vocabulary than the one this "
                              "run was trained with (see draft_vocab.json): resume with the run's data")


def _restore(run: _Run, resume: bool, progress: bool) -> TrainState:
    """The initial state (init_from or random), or the latest checkpoint's with the data iterator moved to match."""
    cfg = run.cfg
    state = put_global(TrainState(jnp.int32(0), run.start, run.tx.init(run.start)), run.state_shardings)
    if resume:
        step = run.manager.latest_step()
        try:
            restored = run.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)),
                data=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many kinds (KeyError, ValueError, decode errors) for a damaged checkpoint
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise SpecformerError(f"--resume: could not restore checkpoint {run.manager.directory / str(step)} "
                                  f"({type(e).__name__}: {first}); delete it to resume from an earlier one") from None
        state = restored["state"]
        # Process 0 wrote its iterator position; every process's iterator has taken as many batches, so the
        # position is the same on all of them.
        run.data.set_state(restored["data"])
        if run.is_main and progress:
            print(f"specformer: resuming {run.out} from its checkpoint at step {step} of {cfg.steps}", file=sys.stderr)
    run.out.mkdir(parents=True, exist_ok=True)
    if run.is_main:
        write_json(run.out / "train_config.json", cfg.settings())
        if run.vocab is not None:
            write_json(run.out / VOCAB_FILE, run.vocab.tolist())
    return state


def _loop(run: _Run, state: TrainState, resume: bool, progress: bool) -> tuple[TrainState, dict]:
    """Train to cfg.steps: log every log_every steps, eval every eval_every, save every save_every; Ctrl-C saves the
    step it stopped at. Returns the final state and the last eval's metrics."""
    cfg, step = run.cfg, int(state.step)
    data_state = run.data.get_state()  # data position matching `state`: saved together, always
    bar = tqdm(total=cfg.steps, initial=step, desc="train", file=sys.stderr, disable=not (progress and run.is_main))
    last_eval: dict = {}
    if resume and step % cfg.eval_every == 0:  # Ctrl-C during this step's eval saved the step but not the eval
        last_eval = run.evaluate(state, step, unless_logged=True)
    try:
        t0, tokens, since = time.perf_counter(), 0, step
        while step < cfg.steps:
            batch = next(run.data)
            placed = put_process_batch(batch, run.mesh)  # this process's rows of the global batch
            state, metrics = run.train_step(state, run.target.params, placed)
            step, data_state = step + 1, run.data.get_state()
            tokens += _answer_tokens(batch, placed)
            if step % cfg.log_every == 0 or step == cfg.steps:
                _log_train(run, step, {k: np.asarray(v).tolist() for k, v in metrics.items()}, tokens,
                           time.perf_counter() - t0, step - since, bar)
                t0, tokens, since = time.perf_counter(), 0, step
            if step % cfg.eval_every == 0:
                last_eval = run.evaluate(state, step)
            if step % cfg.save_every == 0:
                run.save(step, state, data_state)
            bar.update(1)
    except KeyboardInterrupt:
        alive = not any(x.is_deleted() for x in jax.tree.leaves(state))  # donated if stopped inside a step
        if alive and run.manager.latest_step() != step:
            run.save(step, state, data_state)
        where = step if alive else run.manager.latest_step()
        raise SpecformerError(f"interrupted; checkpoint at step {where} kept, continue with --resume") from None
    finally:
        bar.close()
    if run.manager.latest_step() != step:
        run.save(step, state, data_state)
    return state, last_eval


def _log_train(run: _Run, step: int, metrics: dict, tokens: int, seconds: float, steps: int, bar) -> None:
    """One logged training step: metrics.jsonl, the progress bar, and (several processes) every process's loss."""
    if not np.isfinite(metrics["loss"]):  # nothing after this is worth saving or exporting
        raise SpecformerError(f"the loss is {metrics['loss']} at step {step}: training diverged (lr too high?); "
                              f"checkpoints up to step {run.manager.latest_step()} are kept")
    run.log({"split": "train", "step": step, "answer_tokens_per_second": tokens / seconds,
             "seconds_per_step": seconds / steps, **metrics})
    bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['accuracy_per_slot'][0]:.2f}")
    if jax.process_count() > 1:  # every process reports the (global) loss it computed
        tqdm.write(f"specformer: process {jax.process_index()}/{jax.process_count()}: step {step} "
                   f"loss {metrics['loss']:.6f}", file=sys.stderr)


def _export(run: _Run, state: TrainState, last_eval: dict) -> dict:
    """The last eval (when the steps did not end on one), the final plot and the drafter directory."""
    cfg, step = run.cfg, int(state.step)
    if cfg.steps % cfg.eval_every:
        last_eval = run.evaluate(state, step)
    params = to_host(state.params)  # a collective with several processes: all take part, process 0 writes
    if run.is_main:
        plot_training(run.out / "metrics.jsonl", run.out / "training_curve.png")
        save_drafter(run.out / "drafter", cfg.drafter, DrafterParams(params, run.vocab), run.target.cfg, meta={
            "target_source": run.target.source, "train_config": cfg.settings(), "eval": last_eval},
            vocab_meta=run.vocab_meta)
    return {"step": step, "eval": last_eval, "state": state}
