"""`generate(model, prompts, ...)` and `generate_stream`: the decoding entry points of the Python API and the CLI.
They take their options as one DecodeOptions (options.py), check them against the model, convert the model to its
decoding layout in place (on a mesh when given one), decide the draft length (tuning/draft_len.py), make the plan,
draft source and acceptance rule the engine is given, run the requests on the engine (scheduler.py) and, when given
a records store, fold what speculative decoding measured into it (records.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from specformer_jax import defaults
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.set_acceptance import SetAcceptance, law_accepted_length
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.drafts import kinds as drafters
from specformer_jax.decoding.encode import Prompt, check_fits, checked_prompts, encode_prompts
from specformer_jax.decoding.engine.plan import DecodePlan, make_plan
from specformer_jax.decoding.engine.runner import DecodeRun
from specformer_jax.decoding.engine.scheduler import decode_requests, run_to_end
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.decoding.options import DecodeOptions, decode_options, with_options_signature
from specformer_jax.decoding.tuning.cost_model import DraftLenChoice
from specformer_jax.decoding.tuning.draft_len import (
    checked_draft_len,
    checked_verify_budget,
    decide_draft_len,
    default_budgeted_round,
    hybrid_model_len,
    typical_cache_len,
)
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.tuner import AutoDraftLen, BudgetChoice, choose_budget
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget, checked_target
from specformer_jax.parallel import AXES, make_mesh, replicated


@dataclasses.dataclass
class GenerationResult:
    """What `generate` returns: per prompt the answer's text and token ids, and the stats of the call."""

    texts: list[str | None]  # None when the model has no tokenizer
    token_ids: list[list[int]]  # generated ids per prompt, EOS included when it was produced
    stats: dict[str, Any]

    def to_json(self) -> dict:
        return {"results": [{"text": t, "token_ids": ids} for t, ids in zip(self.texts, self.token_ids)],
                "stats": self.stats}


@with_options_signature
def generate(model: LoadedTarget, prompts: Sequence[Prompt], *, options: DecodeOptions | None = None,
             **keywords) -> GenerationResult:
    """Decode every prompt (text, through the chat template unless chat=False, or token ids; ragged lengths are
    fine) on a pool of `batch_size` slots, fully on the device; results in input order, with the call's stats.

    `options`: a DecodeOptions, or its fields as keywords (`generate(model, prompts, max_new_tokens=8,
    draft_len=2)`; keywords given with `options` replace its fields). DecodeOptions says what each one does and its
    default.

    `model`: what load_target returns. Its weights are converted to the decoding layout IN PLACE, so that they live
    once (a copy would double their memory): `model.layout` names the layout they are in after the call, and
    stats["layout"] the one the call decoded in. To convert once, at load time:
    `model = load_target(path).use_decoding_layout(batch_size)`. Every layout computes the same function.

    With a drafter, decoding is speculative: greedy gives the same tokens as without it, sampling the same
    distribution. Ctrl-C stops decoding at the next chunk boundary (raising scheduler.Interrupted, a
    KeyboardInterrupt that says how many prompts were done).
    """
    options = decode_options("generate", options, keywords)
    return run_to_end(_decode(_prepare(model, prompts, options), stream=False))


@with_options_signature
def generate_stream(model: LoadedTarget, prompts: Sequence[Prompt], *, options: DecodeOptions | None = None,
                    **keywords) -> Iterator[tuple[int, list[int]]]:
    """`generate` as an iterator, with the same options (and the same conversion of `model` in place): yields
    (prompt index, new token ids) as chunks of rounds finish, so text can be shown as it is made; its return value
    (StopIteration.value) is the GenerationResult. The options are checked (and --draft-len auto chosen) before
    this returns."""
    return _decode(_prepare(model, prompts, decode_options("generate_stream", options, keywords)), stream=True)


@dataclasses.dataclass
class _Job:
    """A checked call: what to decode, with what, and how."""

    model: LoadedTarget
    drafter: drafters.Drafter | None
    ids: list[list[int]]
    plan: DecodePlan
    source: Any  # the draft source (speculative plans; drafters.draft_source)
    accept: Verify | SetAcceptance
    chunk_rounds: int
    row_keys: jax.Array
    pool_size: int
    mesh: Mesh | None
    auto: DraftLenChoice | None
    set_acceptance: float | None
    options: DecodeOptions
    verify_budget: int | tuple = 0  # positions, or sizes with their costs (engine/budget.py)
    budget_choice: BudgetChoice | None = None  # what --verify-budget auto chose, sizes or plain decoding


def _prepare(model, prompts, options: DecodeOptions) -> _Job:
    """A call's options checked against the model, and what they make: the model in its decoding layout (converted
    in place), the draft length, the plan, the draft source and the acceptance rule."""
    model, prompts = checked_target(model), checked_prompts(prompts)
    drafter = resolve_drafter(options.drafter, model) if isinstance(options.drafter, str) else options.drafter
    if drafter is not None:
        drafter = drafters.checked_drafter(drafter, model.cfg)
    draft_len = checked_draft_len(drafter, options.draft_len, options.records)
    rate = _checked_rate(options.set_acceptance, draft_len)
    mesh = _checked_mesh(options.mesh)
    ids = encode_prompts(model, prompts, options.chat)
    check_fits(ids, options.max_new_tokens, options.max_cache_len or model.cfg.max_position,
               "cache positions but the cache holds")
    B = min(options.batch_size, len(ids))
    if mesh is not None:
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        B = -(-B // rows) * rows
    model.use_decoding_layout(B, mesh)
    budgeted = default_budgeted_round(drafter, B, model.cfg.pack_weights) if (
        draft_len is None and options.verify_budget is None) else None
    if budgeted:  # the measured default round: k drafts a row, a budget of positions over the pool
        (k, budget), auto = budgeted, None
    else:
        k, auto = decide_draft_len(draft_len, drafter, model, B, ids=ids, max_new_tokens=options.max_new_tokens,
                                   sampled=not options.sampling.greedy, schedule=options.schedule,
                                   progress=options.progress)
        budget = checked_verify_budget(options.verify_budget, k, B)
    budget_choice = None
    if budget == "auto":
        budget_choice = choose_budget(model, drafters.specformer_only(drafter, "--verify-budget auto"), B,
                                      typical_cache_len(ids, options.max_new_tokens), k,
                                      options.records or DecodeRecords(), sampled=not options.sampling.greedy,
                                      progress=options.progress)
        k, budget = (0, 0) if budget_choice.plain else (k, budget_choice.sizes)
        if options.progress:
            print(f"specformer: --verify-budget auto at batch {B}: {budget_choice.reason}", file=sys.stderr)
    plan = make_plan(model, k, options.sampling, options.max_new_tokens)
    source = drafters.draft_source(drafter, mesh, model.cfg, hybrid_model_len(drafter, B, model.cfg)) if k else None
    return _Job(model, drafter, ids, plan, source, _accept_rule(rate, mesh),
                options.chunk_rounds or defaults.CHUNK_ROUNDS, _row_keys(options.seed, len(prompts)), B, mesh, auto,
                rate, options, budget, budget_choice)


def _decode(job: _Job, stream: bool):
    """Run a prepared call: yields (prompt index, new tokens) when `stream`; returns the GenerationResult."""
    schedule, records = job.options.schedule, job.options.records
    with tqdm(total=len(job.ids), desc="specformer: decoding", unit="prompt", file=sys.stderr,
              disable=not job.options.progress) as bar:
        run = yield from decode_requests(job.plan, job.model.params, job.source, job.ids, job.pool_size, job.row_keys,
                                         accept=job.accept, chunk_rounds=job.chunk_rounds, schedule=schedule,
                                         mesh=job.mesh, stream=stream, verify_budget=job.verify_budget,
                                         on_finished=lambda done: bar.update(done - bar.n))
    plan, model = job.plan, job.model
    stats = {**run.stats(), "batch_size": job.pool_size, "schedule": schedule, "chunk_rounds": job.chunk_rounds,
             "device": jax.devices()[0].device_kind, "dtype": model.cfg.dtype, "layout": model.layout}
    if job.drafter is not None:
        stats["draft_len"] = plan.draft_len
        stats["verify_budget"] = job.budget_choice.to_json() if job.budget_choice else job.verify_budget
    if job.auto is not None:
        stats["draft_len_auto"] = job.auto.to_json()
        if job.budget_choice is not None and job.budget_choice.plain:  # its k was not what decoded
            stats["draft_len_auto"]["overridden"] = "--verify-budget auto decoded plainly (stats[\"verify_budget\"])"
    stats.update(run.speculative_stats())
    if job.set_acceptance is not None:
        stats.update(set_acceptance=job.set_acceptance,
                     law_accepted_length=law_accepted_length(job.set_acceptance, plan.draft_len))
    elif records is not None and plan.speculative and isinstance(job.drafter, LoadedDrafter) and not job.verify_budget:
        # a budget leaves drafts unverified: the per-slot acceptance auto learns from would read them as rejected
        _record(records, model, job.drafter, plan.sampling, job.pool_size, plan.draft_len, run, stats)
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in run.token_ids]
    return GenerationResult(texts, run.token_ids, stats)


def _accept_rule(rate: float | None, mesh: Mesh | None) -> Verify | SetAcceptance:
    """Verification by the target, or (a cost measurement) acceptance set at `rate`, replicated over the mesh."""
    if rate is None:
        return Verify()
    rule = SetAcceptance(jnp.float32(rate))
    return rule if mesh is None else jax.device_put(rule, replicated(mesh))


def _checked_rate(rate: float | None, draft_len: int | None | AutoDraftLen) -> float | None:
    """The set acceptance rate (checked in DecodeOptions), refused without a fixed draft length."""
    if rate is None:
        return None
    if not draft_len or isinstance(draft_len, AutoDraftLen):  # None: the default, which depends on the batch size
        raise SpecformerError("set_acceptance needs speculative decoding with a fixed draft_len (a drafter and "
                              "draft_len >= 1, not auto)")
    return rate


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


def _record(records: DecodeRecords, model, drafter, sampling: SamplingConfig, batch_size: int, draft_len: int,
            run: DecodeRun, stats: dict) -> None:
    records.add_run(model, drafter, not sampling.greedy, batch_size=batch_size, draft_len=draft_len,
                    acceptance=stats["acceptance_rate_per_slot"], rounds=stats["rounds"],
                    plain_steps=run.plain_steps or 0, batch_rounds=run.steps if run.plain_steps is not None else 0)
