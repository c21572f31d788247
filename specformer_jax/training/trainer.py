"""Drafter training loop: jitted mesh-sharded step, optax AdamW + warm-up/cosine, orbax checkpoints that also hold the
data iterator position (so a resumed run sees exactly the batches an uninterrupted run would), metrics JSONL."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import struct
from tqdm import tqdm

from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
from specformer_jax.checkpoints.loader import LoadedTarget, load_target
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.parallel import (barrier, batch_sharded, like_params, make_mesh, param_shardings, put_global,
                                     put_process_batch, replicated, to_host)
from specformer_jax.training.data import eval_batches, is_eval_record, training_batches
from specformer_jax.training.distill import check_token_ids, check_vocabulary
from specformer_jax.training.loss import drafter_loss, metrics_from_sums
from specformer_jax.training.plots import plot_training
from specformer_jax.training.train_config import DRAFTER_SETTINGS, TrainConfig


@struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), cfg.min_lr)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.999, eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
    )


def train_shardings(target: LoadedTarget, cfg: TrainConfig, tx, mesh):
    """(train state shardings, target parameter shardings) on `mesh` (see specformer_jax.parallel)."""
    dparams = jax.eval_shape(lambda: init_drafter(target.cfg, cfg.drafter(), jax.random.key(0)))
    opt_state = jax.eval_shape(tx.init, dparams)
    state = TrainState(replicated(mesh), param_shardings(dparams, mesh), like_params(opt_state, dparams, mesh))
    return state, param_shardings(target.params, mesh)


def make_steps(target: LoadedTarget, cfg: TrainConfig, tx, mesh):
    """(train_step, eval_step), jitted with explicit shardings: batches over the batch axes, the frozen target and
    the drafter's parameters and optimizer state by the logical-axis rules (FSDP and tensor parallel)."""
    loss_fn = jax.tree_util.Partial(drafter_loss, target_cfg=target.cfg, drafter_cfg=cfg.drafter(),
                                    chunk_positions=cfg.chunk_positions, objective=cfg.objective)

    def train_step(state: TrainState, target_params, batch):
        (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params, target_params, batch["tokens"], batch["label_mask"]
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


def _jsonable(metrics: dict) -> dict:
    return {k: (np.asarray(v).tolist()) for k, v in metrics.items()}


def load_records(dirs: str, setting: str = "data", for_training: bool = True) -> list[dict]:
    """The records of one directory written by `specformer distill`, or of several given as "dir1,dir2" (in order;
    each keeps its own prompt indices, so its held-out split is the one eval-drafter uses on it alone)."""
    from specformer_jax.training.distill import read_distilled

    paths = data_dirs(dirs)
    if not paths:
        raise SpecformerError(f"no data: set `{setting}` to a directory written by `specformer distill` "
                              "(several: dir1,dir2)")
    return [r for d in paths for r in read_distilled(d, for_training=for_training)]


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


def data_dirs(dirs: str | None) -> list[Path]:
    """The directories of a `data` / `eval_data` setting ("dir1,dir2")."""
    return [Path(d.strip()) for d in (dirs or "").split(",") if d.strip()]


def _check_resumable(out: Path, cfg: TrainConfig) -> None:
    """Refuse to resume a run whose checkpoints hold another drafter than these settings make."""
    try:
        saved = json.loads((out / "train_config.json").read_text())
    except (OSError, ValueError):
        return  # nothing readable to compare with: the restore itself checks shapes
    mine = dataclasses.asdict(cfg)
    as_set = lambda v: tuple(v) if isinstance(v, list) else v  # JSON keeps hooks as a list
    diff = [f"{k}={saved[k]!r} (now {mine[k]!r})" for k in DRAFTER_SETTINGS
            if isinstance(saved, dict) and k in saved and as_set(saved[k]) != mine[k]]
    if diff:
        raise SpecformerError(f"--resume: {out} was trained with {', '.join(diff)}; resume with its drafter "
                              "settings, or choose another out")
    if isinstance(saved, dict) and saved.get("model", cfg.model) != cfg.model:  # a moved checkpoint is fine
        print(f"specformer: warning: {out} was trained on model {saved['model']}, resuming with {cfg.model}",
              file=sys.stderr)


def initial_params(cfg: TrainConfig, target: LoadedTarget):
    """Random drafter parameters, or those of the drafter directory `init_from`. Its settings must be the run's, except
    that a run may add next_token_input to a drafter without it: the new input starts at zero, so the run continues
    exactly where that drafter stands."""
    fresh = lambda: init_drafter(target.cfg, cfg.drafter(), jax.random.key(cfg.seed))
    if cfg.init_from is None:
        return fresh()
    start = load_drafter(cfg.init_from, target)
    if start.cfg == cfg.drafter():
        return start.params
    if cfg.next_token_input and start.cfg == dataclasses.replace(cfg.drafter(), next_token_input=False):
        return {**fresh(), **start.params}
    raise SpecformerError(f"init_from {cfg.init_from}: its drafter settings {start.cfg} differ from this run's "
                          f"{cfg.drafter()}")


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) a training run; returns the final eval metrics. Everything goes under cfg.out."""
    if not isinstance(cfg, TrainConfig):
        raise SpecformerError(f"cfg must be a TrainConfig (load_train_config(path, overrides)), got {type(cfg).__name__}")
    out = Path(cfg.out).absolute()
    if out.exists() and not out.is_dir():
        raise SpecformerError(f"out {cfg.out} exists and is not a directory")
    ckpt_dir = out / "checkpoints"
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()) and not resume:
        raise SpecformerError(f"{out} already has checkpoints: pass --resume to continue, or choose another out")
    if resume and not (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())):
        raise SpecformerError(f"--resume: no checkpoint under {ckpt_dir}")
    records = load_records(cfg.data)
    train_recs = [r for r in records if not is_eval_record(r["index"], cfg.eval_fraction)]
    eval_recs = ([r for r in records if is_eval_record(r["index"], cfg.eval_fraction)] if cfg.eval_data is None
                 else load_records(cfg.eval_data, "eval_data", for_training=False))
    if train_recs and all(r["prompt_len"] >= cfg.seq_len for r in train_recs):
        raise SpecformerError(f"seq_len {cfg.seq_len} leaves no answer token to learn from: every training prompt is "
                              "at least that long")
    if len(train_recs) < cfg.batch_size:
        raise SpecformerError(f"only {len(train_recs)} training sequences for batch_size {cfg.batch_size}")
    if cfg.batch_size % jax.process_count():
        raise SpecformerError(f"batch_size {cfg.batch_size} must be a multiple of the {jax.process_count()} processes")
    if resume:
        _check_resumable(out, cfg)
    target = load_target(cfg.model, attention_impl=cfg.attention_impl)
    check_vocabulary(data_dirs(cfg.data) + data_dirs(cfg.eval_data), target.cfg.vocab_size)
    check_token_ids(records, target.cfg.vocab_size, cfg.data)
    if cfg.eval_data is not None:
        check_token_ids(eval_recs, target.cfg.vocab_size, cfg.eval_data)
    mesh = make_mesh(cfg.mesh)
    tx = make_optimizer(cfg)
    train_step, eval_step = make_steps(target, cfg, tx, mesh)
    data_iter = iter(training_batches(train_recs, seq_len=cfg.seq_len, batch_size=cfg.batch_size, steps=cfg.steps,
                                      seed=cfg.seed, process_index=jax.process_index(),
                                      process_count=jax.process_count()))
    evals = eval_batches(eval_recs, seq_len=cfg.seq_len, batch_size=cfg.batch_size, num_batches=cfg.eval_batches)
    params = initial_params(cfg, target)
    state_sh, target_sh = train_shardings(target, cfg, tx, mesh)
    state = put_global(TrainState(jnp.int32(0), params, tx.init(params)), state_sh)
    target = dataclasses.replace(target, params=put_global(target.params, target_sh))
    barrier("specformer-train-checked-out-dir")  # every process has checked `out` before any writes to it
    # Every process takes part in checkpoint saves and restores (each writes its own shards; orbax coordinates).
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints,
                                                                                   create=True))
    if resume:
        step = manager.latest_step()
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, state)),
                data=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many kinds (KeyError, ValueError, decode errors) for a damaged checkpoint
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise SpecformerError(f"--resume: could not restore checkpoint {ckpt_dir / str(step)} "
                                  f"({type(e).__name__}: {first}); delete it to resume from an earlier one") from None
        state = restored["state"]
        # Process 0 wrote its iterator position; every process's iterator has taken as many batches, so the
        # position is the same on all of them.
        data_iter.set_state(restored["data"])
    is_main = jax.process_index() == 0
    if resume and is_main and progress:
        print(f"specformer: resuming {out} from its checkpoint at step {step} of {cfg.steps}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "metrics.jsonl", "a") if is_main else None
    if is_main:
        (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")

    def save(step: int, state, data_state):
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   data=ocp.args.JsonSave(data_state)))
        manager.wait_until_finished()

    def write(record: dict):
        if is_main:
            log.write(json.dumps(record) + "\n")
            log.flush()

    def run_eval(step: int, unless_logged: bool = False) -> dict:
        if not evals:
            return {}
        m = _summaries([eval_step(state.params, target.params, put_global(b, batch_sharded(mesh))) for b in evals])
        if unless_logged and is_main and step in _logged_eval_steps(out / "metrics.jsonl"):
            return m
        write({"split": "eval", "step": step, **m})
        if is_main:
            acc = " ".join(f"{a:.3f}" for a in m["accuracy_per_slot"])
            tqdm.write(f"eval step {step}: loss {m['loss']:.4f}, accuracy per slot [{acc}], "
                       f"expected accepted length {m['expected_accepted_length']:.3f} (in decoding "
                       f"{m['decoding_accepted_length']:.3f})")
            plot_training(out / "metrics.jsonl", out / "training_curve.png")  # the curve so far, to look at mid-run
        return m

    step = int(state.step)
    data_state = data_iter.get_state()  # data position matching `state`: saved together, always
    bar = tqdm(total=cfg.steps, initial=step, desc="train", file=sys.stderr, disable=not (progress and is_main))
    last_eval: dict = {}
    if resume and step % cfg.eval_every == 0:  # Ctrl-C during this step's eval saved the step but not the eval
        last_eval = run_eval(step, unless_logged=True)
    try:
        t0, tokens, since = time.perf_counter(), 0, step
        while step < cfg.steps:
            batch = next(data_iter)
            placed = put_process_batch(batch, mesh)  # this process's rows of the global batch
            state, metrics = train_step(state, target.params, placed)
            step, data_state = step + 1, data_iter.get_state()
            tokens += _answer_tokens(batch, placed)
            if step % cfg.log_every == 0 or step == cfg.steps:
                metrics = _jsonable(metrics)
                if not np.isfinite(metrics["loss"]):  # nothing after this is worth saving or exporting
                    raise SpecformerError(f"the loss is {metrics['loss']} at step {step}: training diverged (lr too "
                                          f"high?); checkpoints up to step {manager.latest_step()} are kept")
                dt = time.perf_counter() - t0
                write({"split": "train", "step": step, "answer_tokens_per_second": tokens / dt,
                       "seconds_per_step": dt / (step - since), **metrics})
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['accuracy_per_slot'][0]:.2f}")
                if jax.process_count() > 1:  # every process reports the (global) loss it computed
                    tqdm.write(f"specformer: process {jax.process_index()}/{jax.process_count()}: step {step} "
                               f"loss {metrics['loss']:.6f}", file=sys.stderr)
                t0, tokens, since = time.perf_counter(), 0, step
            if step % cfg.eval_every == 0:
                last_eval = run_eval(step)
            if step % cfg.save_every == 0:
                save(step, state, data_state)
            bar.update(1)
    except KeyboardInterrupt:
        alive = not any(x.is_deleted() for x in jax.tree.leaves(state))  # donated if stopped inside a step
        if alive and manager.latest_step() != step:
            save(step, state, data_state)
        where = step if alive else manager.latest_step()
        raise SpecformerError(f"interrupted; checkpoint at step {where} kept, continue with --resume") from None
    finally:
        bar.close()
    if manager.latest_step() != step:
        save(step, state, data_state)
    if cfg.steps % cfg.eval_every:
        last_eval = run_eval(step)
    params = to_host(state.params)  # a collective with several processes: all take part, process 0 writes
    if is_main:
        log.close()
        plot_training(out / "metrics.jsonl", out / "training_curve.png")
        save_drafter(out / "drafter", cfg.drafter(), params, target.cfg,
                     meta={"target_source": target.source, "train_config": dataclasses.asdict(cfg), "eval": last_eval})
    return {"step": step, "eval": last_eval, "state": state}
