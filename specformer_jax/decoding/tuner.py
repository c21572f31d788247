"""How many drafts per round: the default, the check of a requested number, and `AutoDraftLen`, the tuner behind
`--draft-len auto` (cost_model.py holds the model it predicts with, records.py what it learns from)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.checks import NON_NEGATIVE, is_int
from specformer_jax.decoding import cost_model
from specformer_jax.decoding.records import DecodeRecords
from specformer_jax.decoding.timing import measure_costs
from specformer_jax.errors import SpecformerError


def default_draft_len(drafter: LoadedDrafter) -> int:
    """Drafts per round when none is asked for: every trained slot on an accelerator, one on a CPU. There a matmul
    over a few rows costs several times one row's rather than one read of the weights, so each further draft adds to a
    round about what it saves (benchmarks/README.md, "CPU decoding (2 cores)")."""
    return 1 if jax.default_backend() == "cpu" else drafter.cfg.num_slots


def drafter_acceptance(drafter: LoadedDrafter) -> list[float]:
    """The drafter's recorded per-slot acceptance (from its training eval or `specformer eval-drafter --save`)."""
    rates = (drafter.meta.get("eval") or {}).get("acceptance_rate_per_slot")
    if not rates or len(rates) != drafter.cfg.num_slots:
        raise SpecformerError("--draft-len auto needs the drafter's measured per-slot acceptance, which it does not "
                              "record: run `specformer eval-drafter --drafter D --data DISTILLED_DIR --save` once")
    return [float(r) for r in rates]


@dataclasses.dataclass
class AutoDraftLen:
    """Chooses the drafts per round for the batch size at hand from measured step costs, the drafter's acceptance
    and what batches of that size achieved (cost_model.py). `records`: where it reads and keeps those measurements
    (None: a store in memory that lives as long as this tuner). `measure`: the timing harness (timing.py)."""

    records: DecodeRecords | None = None
    margin: float = cost_model.MARGIN
    measure: Callable = measure_costs

    def __post_init__(self):
        self.records = DecodeRecords() if self.records is None else self.records
        if not isinstance(self.records, DecodeRecords):
            raise SpecformerError(f"records must be a DecodeRecords, got {type(self.records).__name__}")
        self.margin = NON_NEGATIVE.check("margin", self.margin)

    def choose(self, model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
               sampled: bool = False, schedule: str = "continuous", progress: bool = False
               ) -> cost_model.DraftLenChoice:
        """The choice for `batch_size` rows around `cache_len` cached tokens, greedy or sampled (each learns apart).
        The first call for a setup compiles and times K + 1 engines; later ones read the records. The batch rounds
        of static batches correct the prediction on the static schedule only: on the continuous one a row never
        waits for a slower neighbour."""
        acceptance, source = cost_model.combined_acceptance(self.records.acceptance(model, drafter, sampled),
                                                            drafter_acceptance(drafter))
        costs = self.records.step_costs(model, drafter, batch_size, cache_len)
        if costs is None:
            costs = self.measure(model, drafter, batch_size, cache_len, progress=progress)
            self.records.add_step_costs(model, drafter, batch_size, cache_len, costs)
        batches = self.records.batch_rounds(model, drafter, sampled, batch_size) if schedule == "static" else {}
        return cost_model.predict(costs, acceptance, source, batches, self.margin)


def check_draft_len(drafter: LoadedDrafter | None, draft_len, records: DecodeRecords | None = None
                    ) -> int | AutoDraftLen | None:
    """A draft length this drafter can decode with, checked before any compilation: None (the default), an integer
    in 0..slots, or an AutoDraftLen; "auto" is an AutoDraftLen over `records`."""
    if isinstance(draft_len, str) and draft_len == "auto":
        draft_len = AutoDraftLen(records)
    if isinstance(draft_len, AutoDraftLen):
        if drafter is not None:
            drafter_acceptance(drafter)
        return draft_len if drafter is not None else 0
    if draft_len is None:
        return None
    if not is_int(draft_len) or draft_len < 0:
        raise SpecformerError(f"draft_len must be a non-negative integer, \"auto\" or an AutoDraftLen, "
                              f"got {draft_len!r}")
    if drafter is None and draft_len:
        raise SpecformerError(f"draft_len={draft_len} needs a drafter (drafter=load_drafter(path, model))")
    if drafter is not None and draft_len > drafter.cfg.num_slots:
        raise SpecformerError(f"draft_len must be in 0..{drafter.cfg.num_slots} for this drafter, got {draft_len}")
    return int(draft_len)
