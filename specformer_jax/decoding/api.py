"""`generate(model, prompts, ...)` and `generate_stream`: the decoding entry points of the Python API and the CLI.
They check their arguments, resolve the draft length to an int (the tuner choosing for "auto"), hold the model in
its decoding layout (on a mesh when given one), make the plan, draft source and acceptance rule the engine is given,
run the requests on the engine (scheduler.py) and, when given a records store, fold what speculative decoding
measured into it (records.py)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm import tqdm

from specformer_jax.checks import FRACTION, POSITIVE_INT, SEED, integer, is_int
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.set_acceptance import SetAcceptance, law_accepted_length
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.drafts import kinds as drafters
from specformer_jax.decoding.drafts.ngram import parse_ngram
from specformer_jax.decoding.encode import Prompt, check_fits, checked_prompts, encode_prompts
from specformer_jax.decoding.engine.plan import CHUNK_ROUNDS, DecodePlan, make_plan
from specformer_jax.decoding.engine.runner import DecodeRun
from specformer_jax.decoding.engine.scheduler import SCHEDULES, decode_requests, run_to_end
from specformer_jax.decoding.tuning.cost_model import DraftLenChoice
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.tuner import AutoDraftLen, drafter_acceptance
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


def generate(model: LoadedTarget, prompts: Sequence[Prompt], *, max_new_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 8, chat: bool = True,
             max_cache_len: int | None = None, progress: bool = False, drafter: drafters.Drafter | str | None = None,
             draft_len: int | str | AutoDraftLen | None = None, schedule: str = "continuous",
             chunk_rounds: int | None = None, mesh: Mesh | str | None = None, records: DecodeRecords | None = None,
             set_acceptance: float | None = None) -> GenerationResult:
    """Decode every prompt (text, through the chat template unless chat=False, or token ids; ragged lengths are
    fine) on a pool of `batch_size` slots, fully on the device; results in input order. `model`: what load_target
    returns (its weights are converted to the decoding layout in place, once: LoadedTarget.use_decoding_layout).

    With a drafter, decoding is speculative: greedy gives the same tokens as without it, sampling the same
    distribution. Ctrl-C stops decoding at the next chunk boundary (raising scheduler.Interrupted, a
    KeyboardInterrupt that says how many prompts were done).

    `max_new_tokens`: the answer's budget. `temperature` (0: greedy), `top_k` (0: off), `top_p`, `seed`: sampling;
    a prompt's samples depend on the seed and its index, not on its batch. `batch_size`: slots of the pool (rows
    decoded at once). `max_cache_len`: positions a row may use (default: the model's context length). `progress`:
    a progress bar on stderr. `drafter`: a LoadedDrafter (load_drafter), the n-gram lookup (NgramDrafts, or
    "ngram" / "ngram:MIN-MAX": any model, no training) or a Hybrid of both (Hybrid(load_drafter(...)): per row the
    n-gram drafts or the drafter's). `draft_len`: drafts per round, at most a SpecFormer
    drafter's trained slots (16 for the n-gram lookup and hybrids; default, drafters.default_draft_len: on an
    accelerator all trained slots, 4 for the lookup alone; on a CPU at batch 1 2 for a SpecFormer drafter, 7 for the
    lookup and hybrids, at batch 2 1, 2 and 4, plain decoding beyond; 0: plain decoding), or "auto" (an
    AutoDraftLen reading and keeping `records`) or an AutoDraftLen tuner: chosen for this batch size from measured
    costs and acceptance (docs/decoding.md). `schedule`: "continuous" (a finished prompt's slot is refilled from the
    queue at the next chunk boundary) or "static" (batches of `batch_size` prompts, each run until its slowest row
    is done). `chunk_rounds`: rounds (plain steps or speculative rounds) the device runs between two looks of the
    host, 1..max_new_tokens (default plan.CHUNK_ROUNDS). `mesh` (specformer_jax.parallel.make_mesh, or its spec such
    as "data=4,tensor=2"): rows sharded over its batch axes, the model by its weights' logical axes; batch_size is
    rounded up to a multiple of the batch axes. `records`: a DecodeRecords store that the call's measured
    acceptance (and a static schedule's batch rounds) are folded into: what "auto" learns from. None: the call
    records nothing, so it does not change a later choice. `set_acceptance` (a rate in [0, 1], speculative decoding
    with a fixed draft_len): every round runs as usual, but each draft is accepted with this probability when the
    ones before it were, instead of when the target agrees: the text is meaningless, the cost is that of a drafter
    with this acceptance (set_acceptance.py). Such a call records nothing.
    """
    return run_to_end(_decode(_prepare(**locals()), stream=False))  # locals(): the arguments above, by name


def generate_stream(model: LoadedTarget, prompts: Sequence[Prompt], *, max_new_tokens: int = 128,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, batch_size: int = 8,
                    chat: bool = True, max_cache_len: int | None = None, progress: bool = False,
                    drafter: drafters.Drafter | str | None = None, draft_len: int | str | AutoDraftLen | None = None,
                    schedule: str = "continuous", chunk_rounds: int | None = None, mesh: Mesh | str | None = None,
                    records: DecodeRecords | None = None,
                    set_acceptance: float | None = None) -> Iterator[tuple[int, list[int]]]:
    """`generate` as an iterator, with the same arguments: yields (prompt index, new token ids) as chunks of rounds
    finish, so text can be shown as it is made; its return value (StopIteration.value) is the GenerationResult. The
    arguments are checked (and --draft-len auto chosen) before this returns."""
    return _decode(_prepare(**locals()), stream=True)  # locals(): the arguments above, by name


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
    schedule: str
    mesh: Mesh | None
    records: DecodeRecords | None
    progress: bool
    auto: DraftLenChoice | None
    set_acceptance: float | None


def _prepare(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, batch_size, chat, max_cache_len,
             progress, drafter, draft_len, schedule, chunk_rounds, mesh, records, set_acceptance) -> _Job:
    """The arguments of `generate`, checked, and what they make: the model in its decoding layout, the plan, the
    draft source and the acceptance rule."""
    model, prompts = checked_target(model), checked_prompts(prompts)
    max_new_tokens, batch_size = POSITIVE_INT.check("max_new_tokens", max_new_tokens), POSITIVE_INT.check(
        "batch_size", batch_size)
    chunk_rounds = _checked_chunk_rounds(chunk_rounds, max_new_tokens)
    if schedule not in SCHEDULES:
        raise SpecformerError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    row_keys = _row_keys(SEED.check("seed", seed), len(prompts))
    if records is not None and not isinstance(records, DecodeRecords):
        raise SpecformerError(f"records must be a DecodeRecords, got {type(records).__name__}")
    if isinstance(drafter, str) and drafter.startswith("ngram"):
        drafter = parse_ngram(drafter)
    if drafter is not None:
        drafter = drafters.checked_drafter(drafter, model.cfg)
    draft_len = resolve_draft_len(drafter, draft_len, records)
    rate = _checked_rate(set_acceptance, draft_len)
    mesh = _checked_mesh(mesh)
    ids = encode_prompts(model, prompts, chat)
    check_fits(ids, max_new_tokens, max_cache_len or model.cfg.max_position, "cache positions but the cache holds")
    B = min(batch_size, len(ids))
    if mesh is not None:
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        B = -(-B // rows) * rows
    model.use_decoding_layout(B, mesh)
    if draft_len is None:
        draft_len = drafters.default_draft_len(drafter, B, model.cfg.pack_weights)
    auto = None
    if isinstance(draft_len, AutoDraftLen):
        auto = _auto_choice(draft_len, model, drafter, B, ids, max_new_tokens, sampling, schedule, progress)
        draft_len = auto.draft_len
    plan = make_plan(model, draft_len, sampling, max_new_tokens)
    source = drafters.draft_source(drafter, mesh, model.cfg, B) if draft_len else None
    return _Job(model, drafter, ids, plan, source, _accept_rule(rate, mesh), chunk_rounds, row_keys, B, schedule,
                mesh, records, progress, auto, rate)


def resolve_draft_len(drafter: drafters.Drafter | None, draft_len, records: DecodeRecords | None = None
                      ) -> int | None | AutoDraftLen:
    """The drafts per round to decode with, checked before any compilation: an int (0: plain decoding), None for the
    default (which depends on the pool's size: `default_draft_len`, applied once that is known), or, for "auto" or
    an AutoDraftLen, the tuner that chooses it for each call (an AutoDraftLen over `records`)."""
    if isinstance(draft_len, str) and draft_len == "auto":
        draft_len = AutoDraftLen(records)
    if isinstance(draft_len, AutoDraftLen):
        if drafter is None:
            return 0
        drafter_acceptance(drafters.specformer_only(drafter, "--draft-len auto"))  # refused now if it records none
        return draft_len
    if draft_len is None:
        return None if drafter is not None else 0
    if not is_int(draft_len) or draft_len < 0:
        raise SpecformerError(f"draft_len must be a non-negative integer, \"auto\" or an AutoDraftLen, "
                              f"got {draft_len!r}")
    if drafter is None and draft_len:
        raise SpecformerError(f"draft_len={draft_len} needs a drafter (drafter=load_drafter(path, model))")
    if drafter is not None and draft_len > drafters.max_draft_len(drafter):
        raise SpecformerError(f"draft_len must be in 0..{drafters.max_draft_len(drafter)} for this drafter, got "
                              f"{draft_len}")
    return int(draft_len)


def _decode(job: _Job, stream: bool):
    """Run a prepared call: yields (prompt index, new tokens) when `stream`; returns the GenerationResult."""
    with tqdm(total=len(job.ids), desc="specformer: decoding", unit="prompt", file=sys.stderr,
              disable=not job.progress) as bar:
        run = yield from decode_requests(job.plan, job.model.params, job.source, job.ids, job.pool_size, job.row_keys,
                                         accept=job.accept, chunk_rounds=job.chunk_rounds, schedule=job.schedule,
                                         mesh=job.mesh, stream=stream,
                                         on_finished=lambda done: bar.update(done - bar.n))
    plan, model = job.plan, job.model
    stats = {**run.stats(), "batch_size": job.pool_size, "schedule": job.schedule, "chunk_rounds": job.chunk_rounds,
             "device": jax.devices()[0].device_kind, "dtype": model.cfg.dtype}
    if job.drafter is not None:
        stats["draft_len"] = plan.draft_len
    if job.auto is not None:
        stats["draft_len_auto"] = job.auto.to_json()
    stats.update(run.speculative_stats())
    if job.set_acceptance is not None:
        stats.update(set_acceptance=job.set_acceptance,
                     law_accepted_length=law_accepted_length(job.set_acceptance, plan.draft_len))
    elif job.records is not None and plan.speculative and isinstance(job.drafter, LoadedDrafter):
        _record(job.records, model, job.drafter, plan.sampling, job.pool_size, plan.draft_len, run, stats)
    texts = [model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None
             for t in run.token_ids]
    return GenerationResult(texts, run.token_ids, stats)


def _checked_chunk_rounds(chunk_rounds, max_new_tokens: int) -> int:
    """R, 1..max_new_tokens: every live row emits a token a round, so a longer chunk only runs rounds after every
    row is done (and a huge one would not return for hours, nor stop for Ctrl-C)."""
    if chunk_rounds is None:
        return CHUNK_ROUNDS
    return integer(1, max_new_tokens, f"an integer in 1..max_new_tokens = 1..{max_new_tokens} (every row emits a "
                                      "token a round)").check("chunk_rounds", chunk_rounds)


def _accept_rule(rate: float | None, mesh: Mesh | None) -> Verify | SetAcceptance:
    """Verification by the target, or (a cost measurement) acceptance set at `rate`, replicated over the mesh."""
    if rate is None:
        return Verify()
    rule = SetAcceptance(jnp.float32(rate))
    return rule if mesh is None else jax.device_put(rule, replicated(mesh))


def _checked_rate(rate, draft_len: int | None | AutoDraftLen) -> float | None:
    if rate is None:
        return None
    rate = FRACTION.check("set_acceptance", rate)
    if not draft_len or isinstance(draft_len, AutoDraftLen):  # None: the default, which depends on the batch size
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


def _auto_choice(tuner: AutoDraftLen, model, drafter, batch_size: int, ids, max_new_tokens: int,
                 sampling: SamplingConfig, schedule: str, progress: bool):
    """The tuner's choice around a mid-decode cache length (the mean prompt plus half the answer, rounded up to 64)."""
    typical = -(-(sum(map(len, ids)) // len(ids) + max_new_tokens // 2) // 64) * 64
    choice = tuner.choose(model, drafter, batch_size, typical, sampled=not sampling.greedy, schedule=schedule,
                          progress=progress)
    if progress:
        guess = ", ".join(f"k={k}: {v:.2f}x" for k, v in choice.predicted_speedup.items())
        print(f"specformer: --draft-len auto at batch {batch_size}: {choice.reason} (predicted {guess})",
              file=sys.stderr)
    return choice


def _record(records: DecodeRecords, model, drafter, sampling: SamplingConfig, batch_size: int, draft_len: int,
            run: DecodeRun, stats: dict) -> None:
    records.add_run(model, drafter, not sampling.greedy, batch_size=batch_size, draft_len=draft_len,
                    acceptance=stats["acceptance_rate_per_slot"], rounds=stats["rounds"],
                    plain_steps=run.plain_steps or 0, batch_rounds=run.steps if run.plain_steps is not None else 0)
