"""`generate(model, prompts, ...)` and `generate_stream`: the decoding entry points of the Python API and the CLI.
They check their arguments, place the model on a mesh, choose the draft length, run the requests on the engine
(scheduler.py) and, when given a records store, fold what speculative decoding measured into it (records.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from specformer_jax.checkpoints.drafter_io import LoadedDrafter, check_drafter_fits
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.checks import FRACTION, POSITIVE_INT, SEED
from specformer_jax.decoding.cost_model import DraftLenChoice
from specformer_jax.decoding.encode import Prompt, check_fits, checked_prompts, encode_prompts
from specformer_jax.decoding.plan import CHUNK_ROUNDS, DecodePlan, make_plan
from specformer_jax.decoding.records import DecodeRecords
from specformer_jax.decoding.runner import DecodeRun
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.decoding.scheduler import SCHEDULES, decode_requests, run_to_end
from specformer_jax.decoding.speculative import law_accepted_length
from specformer_jax.decoding.tuner import AutoDraftLen, check_draft_len, default_draft_len
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.target import decoding_params
from specformer_jax.parallel import AXES, make_mesh, param_shardings


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns: per prompt the answer's text and token ids, and the stats of the call."""

    texts: list[str | None]  # None when the model has no tokenizer
    token_ids: list[list[int]]  # generated ids per prompt, EOS included when it was produced
    stats: dict[str, Any]

    def to_json(self) -> dict:
        return {"results": [{"text": t, "token_ids": ids} for t, ids in zip(self.texts, self.token_ids)],
                "stats": self.stats}


def generate(model: LoadedTarget, prompts: Sequence[Prompt], **options) -> GenerationResult:
    """Decode every prompt (text, through the chat template unless chat=False, or token ids; ragged lengths are
    fine) on a pool of `batch_size` slots, fully on the device; results in input order. Options: `generate_stream`.

    With a drafter, decoding is speculative: greedy gives the same tokens as without it, sampling the same
    distribution. Ctrl-C stops decoding at the next chunk boundary (raising scheduler.Interrupted, a
    KeyboardInterrupt that says how many prompts were done).
    """
    return run_to_end(_decode(_prepare(model, prompts, **options), stream=False))


def generate_stream(model: LoadedTarget, prompts: Sequence[Prompt], **options) -> Iterator[tuple[int, list[int]]]:
    """`generate` as an iterator: yields (prompt index, new token ids) as chunks of rounds finish, so text can be
    shown as it is made; its return value (StopIteration.value) is the GenerationResult. The options are checked
    (and --draft-len auto chosen) before this returns."""
    return _decode(_prepare(model, prompts, **options), stream=True)


@dataclasses.dataclass
class _Job:
    """A checked call: what to decode, with what, and how."""

    model: LoadedTarget
    drafter: LoadedDrafter | None
    ids: list[list[int]]
    plan: DecodePlan
    params: Any
    dparams: Any
    row_keys: jax.Array
    pool_size: int
    schedule: str
    mesh: Mesh | None
    records: DecodeRecords | None
    progress: bool
    auto: DraftLenChoice | None
    accept_rate: float | None = None


def _prepare(
    model: LoadedTarget,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    chat: bool = True,
    max_cache_len: int | None = None,
    progress: bool = False,
    drafter: LoadedDrafter | None = None,
    draft_len: int | str | AutoDraftLen | None = None,
    schedule: str = "continuous",
    chunk_rounds: int | None = None,
    mesh: Mesh | str | None = None,
    records: DecodeRecords | None = None,
    set_acceptance: float | None = None,
) -> _Job:
    """The options of `generate`, checked:

    `batch_size`: slots of the pool (rows decoded at once). `draft_len`: drafts per round, at most the drafter's
    trained slots (default: all of them on an accelerator, 1 on a CPU; 0: plain decoding), or "auto" (an
    AutoDraftLen reading and keeping `records`) or an AutoDraftLen tuner: chosen for this batch size from measured
    costs and acceptance (docs/decoding.md). `schedule`: "continuous" (a finished prompt's slot is refilled from
    the queue at the next chunk boundary) or "static" (batches of `batch_size` prompts, each run until its slowest
    row is done). `chunk_rounds`: rounds (plain steps or speculative rounds) the device runs between two looks of
    the host (default plan.CHUNK_ROUNDS). `mesh` (specformer_jax.parallel.make_mesh, or its spec such as
    "data=4,tensor=2"): rows sharded over its batch axes, the model by the logical-axis rules; batch_size is
    rounded up to a multiple of the batch axes. `records`: a DecodeRecords store that the call's measured
    acceptance (and a static schedule's batch rounds) are folded into: what "auto" learns from. None: the call
    records nothing, so it does not change a later choice. `set_acceptance` (a rate in [0, 1], speculative decoding
    with a fixed draft_len): every round runs as usual, but each draft is accepted with this probability when the
    ones before it were, instead of when the target agrees: the text is meaningless, the cost is that of a drafter
    with this acceptance (speculative.set_acceptance). Such a call records nothing.
    """
    prompts = checked_prompts(prompts)
    max_new_tokens, batch_size = POSITIVE_INT.check("max_new_tokens", max_new_tokens), POSITIVE_INT.check(
        "batch_size", batch_size)
    chunk_rounds = CHUNK_ROUNDS if chunk_rounds is None else POSITIVE_INT.check("chunk_rounds", chunk_rounds)
    if schedule not in SCHEDULES:
        raise SpecformerError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    row_keys = _row_keys(SEED.check("seed", seed), len(prompts))
    if records is not None and not isinstance(records, DecodeRecords):
        raise SpecformerError(f"records must be a DecodeRecords, got {type(records).__name__}")
    if drafter is not None:
        check_drafter_fits(drafter, model.cfg)
    draft_len = check_draft_len(drafter, draft_len, records)
    rate = _checked_rate(set_acceptance, drafter, draft_len)
    mesh = _checked_mesh(mesh)
    ids = encode_prompts(model, prompts, chat)
    check_fits(ids, max_new_tokens, max_cache_len or model.cfg.max_position, "cache positions but the cache holds")
    B = min(batch_size, len(ids))
    if mesh is not None:
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        B = -(-B // rows) * rows
    model = _decoding_layout(model, fuse=B == 1)
    params, dparams = _placed(model, drafter, mesh)
    auto = None
    if isinstance(draft_len, AutoDraftLen):
        auto = _auto_choice(draft_len, model, drafter, B, ids, max_new_tokens, sampling, schedule, progress)
        draft_len = auto.draft_len
    k = default_draft_len(drafter) if draft_len is None and drafter is not None else draft_len or 0
    plan = make_plan(model, drafter, k, sampling, max_new_tokens, chunk_rounds, rate is not None)
    return _Job(model, drafter, ids, plan, params, dparams, row_keys, B, schedule, mesh, records, progress, auto, rate)


def _decode(job: _Job, stream: bool):
    """Run a prepared call: yields (prompt index, new tokens) when `stream`; returns the GenerationResult."""
    with tqdm(total=len(job.ids), desc="specformer: decoding", unit="prompt", file=sys.stderr,
              disable=not job.progress) as bar:
        run = yield from decode_requests(job.plan, job.params, job.dparams, job.ids, job.pool_size, job.row_keys,
                                         schedule=job.schedule, mesh=job.mesh, stream=stream,
                                         accept_rate=job.accept_rate, on_finished=lambda done: bar.update(done - bar.n))
    plan, model = job.plan, job.model
    stats = {**run.stats(), "batch_size": job.pool_size, "schedule": job.schedule, "chunk_rounds": plan.chunk_rounds,
             "device": jax.devices()[0].device_kind, "dtype": model.cfg.dtype}
    if job.drafter is not None:
        stats["draft_len"] = plan.draft_len
    if job.auto is not None:
        stats["draft_len_auto"] = job.auto.to_json()
    stats.update(run.speculative_stats())
    if plan.set_acceptance:
        stats.update(set_acceptance=job.accept_rate,
                     law_accepted_length=law_accepted_length(job.accept_rate, plan.draft_len))
    if job.records is not None and plan.speculative and not plan.set_acceptance:
        _record(job.records, model, job.drafter, plan.sampling, job.pool_size, plan.draft_len, run, stats)
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in run.token_ids]
    return GenerationResult(texts, run.token_ids, stats)


_LAYOUTS: dict[tuple[int, bool], tuple[LoadedTarget, LoadedTarget]] = {}  # (id(model), fuse) -> (model, converted)


def _decoding_layout(model: LoadedTarget, fuse: bool) -> LoadedTarget:
    """The model with per-layer parameters (modeling/target.py, `decoding_params`): a step runs faster than under
    the training layout's scan. `fuse` (a pool of one row): q/k/v and gate/up fused, fewer and larger matrix-vector
    products. Converted once per model and layout: the last two are kept. A model already converted is used as is."""
    if model.cfg.unroll_layers:
        return model
    held = _LAYOUTS.get((id(model), fuse))
    if held is None or held[0] is not model:
        cfg, params = decoding_params(model.cfg, model.params, fuse)
        held = _LAYOUTS[(id(model), fuse)] = (model, dataclasses.replace(model, cfg=cfg, params=params))
        while len(_LAYOUTS) > 2:
            del _LAYOUTS[next(iter(_LAYOUTS))]
    return held[1]


def _checked_rate(rate, drafter, draft_len) -> float | None:
    if rate is None:
        return None
    rate = FRACTION.check("set_acceptance", rate)
    if drafter is None or draft_len == 0 or isinstance(draft_len, AutoDraftLen):
        raise SpecformerError("set_acceptance needs speculative decoding with a fixed draft_len (a drafter and "
                              "draft_len >= 1, not auto)")
    return float(rate)


def _row_keys(seed: int, n: int) -> jax.Array:
    """One PRNG key per prompt, from the seed and the prompt's index: a row's samples do not depend on its batch."""
    root = jax.random.key(seed)
    return jax.vmap(lambda i: jax.random.fold_in(root, i))(jnp.arange(n))


def _checked_mesh(mesh) -> Mesh | None:
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    if mesh is not None and not set(AXES) <= set(getattr(mesh, "axis_names", ())):
        raise SpecformerError("mesh must have the axes data, fsdp and tensor: make it with "
                              "specformer_jax.parallel.make_mesh (or pass its spec, e.g. \"data=4,tensor=2\")")
    return mesh


def _placed(model: LoadedTarget, drafter: LoadedDrafter | None, mesh: Mesh | None):
    """(target params, drafter params or None), sharded over `mesh` by the logical-axis rules when one is given."""
    params, dparams = model.params, drafter.params if drafter is not None else None
    if mesh is not None:
        params = jax.device_put(params, param_shardings(params, mesh))
        if dparams is not None:
            dparams = jax.device_put(dparams, param_shardings(dparams, mesh))
    return params, dparams


def _auto_choice(tuner: AutoDraftLen, model, drafter, batch_size: int, ids, max_new_tokens: int,
                 sampling: SamplingConfig, schedule: str, progress: bool):
    """The tuner's choice around a mid-decode cache length (the mean prompt plus half the answer, rounded up to 64)."""
    typical = -(-(sum(map(len, ids)) // len(ids) + max_new_tokens // 2) // 64) * 64
    choice = tuner.choose(model, drafter, batch_size, typical, sampled=not sampling.greedy, schedule=schedule,
                          progress=progress)
    if progress:
        guess = ", ".join(f"k={k}: {v:.2f}x" for k, v in choice.predicted_speedup.items())
        print(f"specformer: --draft-len auto chose {choice.draft_len} for batch {batch_size} (predicted {guess})",
              file=sys.stderr)
    return choice


def _record(records: DecodeRecords, model, drafter, sampling: SamplingConfig, batch_size: int, draft_len: int,
            run: DecodeRun, stats: dict) -> None:
    records.add_run(model, drafter, not sampling.greedy, batch_size=batch_size, draft_len=draft_len,
                    acceptance=stats["acceptance_rate_per_slot"], rounds=stats["rounds"],
                    plain_steps=run.plain_steps or 0, batch_rounds=run.steps if run.plain_steps is not None else 0)
