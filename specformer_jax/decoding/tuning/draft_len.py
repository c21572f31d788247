"""The draft length, decided in one place. What a call asks for (an int, "auto", an AutoDraftLen, or None for the
default) is checked before anything compiles (`checked_draft_len`), then made the int the engine is given once the
pool's size is known (`decide_draft_len`): the user's k, the tuner's choice for "auto" (tuner.py), or the measured
default (`default_draft_len`, from the tables of specformer_jax/defaults.py)."""

from __future__ import annotations

import sys

import jax

from specformer_jax import defaults
from specformer_jax.checks import is_int
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.kinds import Drafter, kind_name, max_draft_len, specformer_only, specformer_part
from specformer_jax.decoding.tuning.cost_model import DraftLenChoice
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.tuner import AutoDraftLen, drafter_acceptance
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedTarget


def checked_draft_len(drafter: Drafter | None, draft_len, records: DecodeRecords | None = None
                      ) -> int | None | AutoDraftLen:
    """The drafts per round a call asks for, checked before any compilation: an int (0: plain decoding), None for
    the default (which depends on the pool's size: `decide_draft_len` applies it once that is known), or, for "auto"
    or an AutoDraftLen, the tuner that chooses it for each call (an AutoDraftLen over `records`)."""
    if isinstance(draft_len, str) and draft_len == "auto":
        draft_len = AutoDraftLen(records)
    if isinstance(draft_len, AutoDraftLen):
        if drafter is None:
            return 0
        drafter_acceptance(specformer_only(drafter, "--draft-len auto"))  # refused now if it records none
        return draft_len
    if draft_len is None:
        return None if drafter is not None else 0
    if not is_int(draft_len) or draft_len < 0:
        raise SpecformerError(f"draft_len must be a non-negative integer, \"auto\" or an AutoDraftLen, "
                              f"got {draft_len!r}")
    if drafter is None and draft_len:
        raise SpecformerError(f"draft_len={draft_len} needs a drafter (drafter=load_drafter(path, model))")
    if drafter is not None and draft_len > max_draft_len(drafter):
        raise SpecformerError(f"draft_len must be in 0..{max_draft_len(drafter)} for this drafter, got {draft_len}")
    return int(draft_len)


def typical_cache_len(ids: list[list[int]], max_new_tokens: int) -> int:
    """The cache length decoding `ids` holds mid-answer (the mean prompt plus half the answer), rounded up to 64: where
    the tuners measure costs."""
    return -(-(sum(map(len, ids)) // len(ids) + max_new_tokens // 2) // 64) * 64


def decide_draft_len(draft_len: int | None | AutoDraftLen, drafter: Drafter | None, model: LoadedTarget,
                     pool_size: int, *, ids: list[list[int]], max_new_tokens: int, sampled: bool, schedule: str,
                     progress: bool) -> tuple[int, DraftLenChoice | None]:
    """The drafts per round for a pool of `pool_size` rows (`model` in the layout it decodes in), from what
    `checked_draft_len` returned: the user's k; for None the default; for a tuner its choice around a mid-decode
    cache length (the mean prompt of `ids` plus half the answer), with that choice (else None)."""
    if isinstance(draft_len, AutoDraftLen):
        choice = draft_len.choose(model, drafter, pool_size, typical_cache_len(ids, max_new_tokens), sampled=sampled,
                                  schedule=schedule, progress=progress)
        if progress:
            guess = ", ".join(f"k={k}: {v:.2f}x" for k, v in choice.predicted_speedup.items())
            print(f"specformer: --draft-len auto at batch {pool_size}: {choice.reason} (predicted {guess})",
                  file=sys.stderr)
        return choice.draft_len, choice
    if draft_len is None:
        return default_draft_len(drafter, pool_size, model.cfg.pack_weights), None
    return draft_len, None


def default_draft_len(drafter: Drafter, pool_size: int, packed: bool) -> int:
    """Drafts per round when none is asked for, for a pool of `pool_size` rows whose target runs in the layout
    `packed` (TargetConfig.pack_weights: the CPU kernels). On an accelerator, `accelerator_draft_len`. On a CPU with
    the kernels, the kind's table in defaults.CPU_DRAFT_LENS (0, plain decoding, for a pool size it does not list; a
    kind it does not list drafts as on an accelerator); on a CPU without them (XLA's matmuls: a bfloat16 model, a
    mesh, no compiler), one, since each further row there costs nearly a row's reading of the weights."""
    if jax.default_backend() != "cpu":
        return accelerator_draft_len(drafter)
    table = defaults.CPU_DRAFT_LENS.get(kind_name(drafter))
    if packed and table is None:
        return accelerator_draft_len(drafter)
    return min(max_draft_len(drafter), defaults.for_pool(table, pool_size) if packed else 1)


def accelerator_draft_len(drafter: Drafter) -> int:
    """Drafts per round by default on a GPU or TPU: every trained slot of a SpecFormer drafter (a hybrid's too); a
    source without one, defaults.ACCELERATOR_NGRAM_DRAFTS."""
    loaded = specformer_part(drafter)
    return loaded.cfg.num_slots if loaded is not None else min(max_draft_len(drafter),
                                                               defaults.ACCELERATOR_NGRAM_DRAFTS)


def hybrid_model_len(drafter: Drafter | None, pool_size: int, target_cfg) -> int | None:
    """For a hybrid, the drafts its round verifies when no live row has n-gram drafts (at least one); None for the
    other kinds. Only a CPU with its kernels narrows rounds (chunk.chunk_widths; defaults.HYBRID_CPU_MODEL_DRAFTS);
    elsewhere every round verifies all k."""
    if not isinstance(drafter, Hybrid):
        return None
    loaded = drafter.drafter
    alone = max(1, default_draft_len(loaded, pool_size, target_cfg.pack_weights))
    if jax.default_backend() != "cpu" or not target_cfg.pack_weights:
        return alone
    return min(loaded.cfg.num_slots, defaults.for_pool(defaults.HYBRID_CPU_MODEL_DRAFTS, pool_size, alone))


def checked_verify_budget(budget: int | str | None, k: int, pool_size: int) -> int | str:
    """Positions a speculative round with k drafts a row verifies over a pool of `pool_size` rows
    (engine/budget.py), 0 for every row's k drafts: the call's budget ("+N": the pool's rows plus N; at least the
    pool's rows, at most all its positions; "auto" as it is, for `measured_sizes`), else 0: a draft length is
    verified whole unless a budget is asked for (the default draft length's default budget is
    `default_budgeted_round`'s)."""
    budget = budget_at(budget, pool_size)
    if not k or not budget:
        return 0
    if budget == "auto":
        return budget
    if budget < pool_size:
        raise SpecformerError(f"verify_budget must be 0 or at least the batch size, {pool_size}, got {budget}")
    return min(budget, pool_size * (k + 1))


def default_budgeted_round(drafter: Drafter | None, pool_size: int, packed: bool) -> tuple[int, int] | None:
    """(drafts per row, positions per round) where the measured defaults verify a budget for a pool of `pool_size`
    rows (defaults.CPU_VERIFY_BUDGETS: a CPU with its kernels and a kind it lists), else None: the default draft
    length, verified whole (`default_draft_len`)."""
    if drafter is None or not packed or jax.default_backend() != "cpu":
        return None
    table = defaults.CPU_VERIFY_BUDGETS.get(kind_name(drafter), {})
    k, budget = defaults.for_pool(table, pool_size, (0, 0))
    k = min(k, max_draft_len(drafter))
    return (k, checked_verify_budget(budget, k, pool_size)) if k else None  # no more than the pool's drafts fill


def default_round(drafter: Drafter | None, pool_size: int, packed: bool) -> tuple[int, int]:
    """(drafts per row, positions per round; 0: every row's drafts) that a pool of `pool_size` rows decodes with when
    no draft length is asked for: the measured budget where there is one, else the default draft length whole."""
    if drafter is None:
        return 0, 0
    return default_budgeted_round(drafter, pool_size, packed) or (default_draft_len(drafter, pool_size, packed), 0)


def budget_at(budget: str | int | None, batch_size: int) -> int | str | None:
    """A verify budget for this batch size (the pool's rows): "+N" is the batch size plus N, a number or "auto"
    itself, None the default."""
    if isinstance(budget, str) and budget != "auto":
        return batch_size + int(budget[1:])
    return budget
