"""`AutoDraftLen`, the tuner behind `--draft-len auto` (cost_model.py holds the model it predicts with, records.py
what it learns from), and `choose_budget`, behind `--verify-budget auto`: the measured verify budgets
(`measured_sizes`), or plain decoding where none pays. The draft length a call asks for is decided in one place,
draft_len.py, which asks this tuner for "auto"."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

from specformer_jax.checks import NON_NEGATIVE
from specformer_jax.decoding.engine.budget import Sizes
from specformer_jax.decoding.tuning import cost_model
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.decoding.tuning.timing import measure_budget_costs, measure_costs
from specformer_jax.defaults import AUTO_MARGIN
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget


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
    margin: float = AUTO_MARGIN
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


@dataclasses.dataclass
class BudgetChoice:
    """What `--verify-budget auto` decodes with at a batch size: the measured sizes each round chooses among, or
    plain decoding where none is predicted to beat it by `margin` (`choose_budget`)."""

    sizes: Sizes  # (positions, cost in plain steps)
    predicted_speedup: float | None  # the best size's tokens per plain step over plain decoding's; None: no acceptance
    margin: float = AUTO_MARGIN

    @property
    def plain(self) -> bool:
        """Whether the call decodes plainly: its best size is predicted to beat plain decoding by less than the
        margin."""
        return self.predicted_speedup is not None and self.predicted_speedup < 1.0 + self.margin

    @property
    def reason(self) -> str:
        """The choice in words, for stats and the progress line."""
        if self.predicted_speedup is None:
            return "a size each round: no per-slot acceptance of every drafted slot to predict with"
        verdict = "plain decoding" if self.plain else "a size each round"
        return (f"{verdict}: the best size is predicted {self.predicted_speedup:.2f}x plain decoding (the margin: "
                f"{self.margin:.0%})")

    def to_json(self) -> dict:
        """stats["verify_budget"] of a call with --verify-budget auto."""
        speedup = None if self.predicted_speedup is None else round(self.predicted_speedup, 3)
        return {"sizes": [[b, round(c, 3)] for b, c in self.sizes], "predicted_speedup": speedup,
                "plain": self.plain, "reason": self.reason}


def predicted_budget_speedup(sizes: Sizes, pool_size: int, acceptance: list[float], k: int) -> float:
    """Tokens per plain step of the best of `sizes` over plain decoding's (the pool's rows): a size's round emits every
    row's token and its drafts, each counted at its slot's mean chance (`acceptance`: slot i and those before it
    accepted), the likeliest slots first; over its cost in plain steps. Ranking drafts by calibrated value verifies
    likelier ones than that, but prefill, rows that finish early and the per-round switch dilute a whole run, which
    the margin is meant to cover."""
    means = sorted((a for a in acceptance[:k] for _ in range(pool_size)), reverse=True)
    return max((pool_size + sum(means[: max(b - pool_size, 0)])) / cost for b, cost in sizes) / pool_size


def choose_budget(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int, k: int,
                  records: DecodeRecords, sampled: bool = False, margin: float = AUTO_MARGIN,
                  progress: bool = False) -> BudgetChoice:
    """`--verify-budget auto` at `batch_size` rows: the sizes (`measured_sizes`), and whether their best is predicted
    to pay, from the per-slot acceptance decoding recorded (else the drafter's eval). A round that verifies no draft
    still pays for the drafter, so where costs are high (many rows on a CPU) plain decoding wins, which choosing a
    size each round cannot reach."""
    sizes = measured_sizes(model, drafter, batch_size, cache_len, k, records, progress=progress)
    try:
        teacher_forced = drafter_acceptance(drafter)
    except SpecformerError:
        teacher_forced = []
    acceptance, _ = cost_model.combined_acceptance(records.acceptance(model, drafter, sampled), teacher_forced)
    speedup = predicted_budget_speedup(sizes, batch_size, acceptance, k) if len(acceptance) >= k else None
    return BudgetChoice(sizes, speedup, margin)


def candidate_budgets(pool_size: int, k: int) -> list[int]:
    """The verify budgets a round with k drafts a row chooses among (engine/budget.py, `best_size`): the pool's rows
    plus none, half, one, two and k drafts a row, as far as k allows. A few only: each is a compiled pass."""
    extras = {0, -(-pool_size // 2), pool_size, 2 * pool_size, k * pool_size}
    return sorted(pool_size + e for e in extras if e <= k * pool_size)


def measured_sizes(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int, k: int,
                   records: DecodeRecords, progress: bool = False) -> Sizes:
    """The `candidate_budgets` with what a round under each costs in plain steps, on this device at this batch size
    around `cache_len` cached tokens: read from `records`, else measured (timing.py) and recorded. A budget costs at
    least what a smaller one does: a measurement that says less is the machine's noise, and would make the round
    take the smaller budget for nothing."""
    budgets = candidate_budgets(batch_size, k)
    costs = records.budget_costs(model, drafter, batch_size, cache_len, k, budgets)
    if costs is None:
        costs = measure_budget_costs(model, drafter, batch_size, cache_len, k, budgets, progress=progress)
        records.add_budget_costs(model, drafter, batch_size, cache_len, k, budgets, costs)
    seconds = itertools.accumulate((costs["budget_seconds"][b] for b in budgets), max)
    return tuple((b, t / costs["step_seconds"]) for b, t in zip(budgets, seconds))
