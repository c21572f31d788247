"""The hybrid draft source (`--drafter default+ngram`, `DIR+ngram`): every round both the SpecFormer drafter and
the n-gram lookup propose; each row takes the source whose drafts it expects more of accepted: the n-gram's by
their measured acceptance at the row's match length (at least `min_match` tokens), the drafter's by its calibrated
confidences, each over the drafts a round verifies for it. One verify pass serves the whole batch, and each row is
verified against the q it drew from (a point mass for n-gram drafts), so output stays lossless, greedy or sampled.

`Hybrid` is the value a user passes (`resolve_drafter("default+ngram", model)` makes it); `HybridDrafts` is the
source the engine runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.checks import integer
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.drafts.ngram import (
    NgramDrafts,
    TokenHistory,
    expected_accepted,
    lookup,
    match_acceptance,
    point_mass,
)
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.defaults import HYBRID_MIN_MATCH
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.loaded import LoadedDrafter


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """A SpecFormer drafter and an n-gram source, chosen between per row and round."""

    drafter: LoadedDrafter
    ngram: NgramDrafts = NgramDrafts()
    min_match: int = HYBRID_MIN_MATCH

    def __post_init__(self):
        integer(1, self.ngram.max_n, f"an integer in 1..{self.ngram.max_n} (the n-gram's max_n)").check(
            "min_match", self.min_match)


@struct.dataclass
class HybridState:
    drafter: KVCache  # the SpecFormer drafter's cache
    history: TokenHistory  # the rows' tokens, for the lookup
    origin: jax.Array  # int32[B]: 0 the drafter's drafts, 1 the n-gram's
    match: jax.Array  # int32[B]: the length of the row's n-gram match (0: none)

    def write_rows(self, new: "HybridState", slots, lens, Tp: int) -> "HybridState":
        put = lambda old, value: old.at[slots].set(value, mode="drop")
        return HybridState(self.drafter.write_rows(new.drafter, slots, lens, Tp),
                           self.history.write_rows(new.history, slots, lens, Tp), put(self.origin, new.origin),
                           put(self.match, new.match))


def takes_lookup(match: jax.Array, mine: jax.Array, copied: jax.Array, widths: tuple[int, int],
                 min_match: int) -> jax.Array:
    """bool[B]: the rows that take the n-gram drafts: a match of at least min_match tokens (int32[B]) whose drafts
    (their chances given the drafts before them, [B, k]: `copied`) are expected to have more accepted over the
    n-gram rows' width than the drafter's (`mine`: its calibrated confidences) over its rows' width
    (widths: (the drafter's, the n-gram's), as `HybridDrafts.widths`)."""
    model_width, ngram_width = widths
    return (match >= min_match) & (expected_accepted(copied, ngram_width) > expected_accepted(mine, model_width))


@struct.dataclass
class HybridDrafts:
    """Both proposals every round, one per row. On a CPU a round verifies k drafts when a live row has the n-gram's,
    else only the first `model_len` (a SpecFormer drafter pays at fewer drafts than a copied span: chunk.run_chunk).
    Drafts past the drafter's trained slots (k larger than them) are the n-gram's for every row."""

    model: SpecformerDrafts
    ngram: NgramDrafts
    min_match: int = struct.field(pytree_node=False, default=HYBRID_MIN_MATCH)
    model_len: int = struct.field(pytree_node=False, default=4)  # drafts a round verifies when no row has n-gram's

    origins = ("specformer", "ngram")

    def widths(self, plan: DecodePlan) -> tuple[int, ...]:
        return min(self.model_len, plan.draft_len), plan.draft_len

    def hooks(self, plan: DecodePlan) -> tuple[int, ...]:
        return self.model.hooks(plan)

    def empty_state(self, plan: DecodePlan, rows: int, max_len: int) -> HybridState:
        zeros = jnp.zeros((rows,), jnp.int32)
        return HybridState(self.model.empty_state(plan, rows, max_len), TokenHistory.zeros(rows, max_len), zeros,
                           zeros)

    def bind(self, plan: DecodePlan, target_params) -> "HybridDrafts":
        return self.replace(model=self.model.bind(plan, target_params))

    def draft(self, plan: DecodePlan, hidden, state: HybridState, num_new, slots_at, next_tokens, keys):
        k, slots = plan.draft_len, min(plan.draft_len, self.model.cfg.num_slots)
        own, q_own, cache = self.model.draft(dataclasses.replace(plan, draft_len=slots), hidden, state.drafter,
                                             num_new, slots_at, next_tokens, keys)
        history = state.history.grow(num_new, next_tokens)
        looked_up, n = lookup(history, k, self.ngram.max_n, self.ngram.min_n)
        q_looked_up = point_mass(plan, looked_up)
        own = jnp.concatenate([own, looked_up[:, slots:]], axis=1)
        q_own = jnp.concatenate([q_own, q_looked_up[:, slots:]], axis=1)
        copied = match_acceptance(n, k)
        use = takes_lookup(n, self._model_rows(plan, own, q_own, cache, copied), copied, self.widths(plan),
                           self.min_match)
        drafts = jnp.where(use[:, None], looked_up, own)
        q = jnp.where(use[:, None, None], q_looked_up, q_own)
        return drafts, q, HybridState(cache, history, use.astype(jnp.int32), n)

    def origin(self, state: HybridState) -> jax.Array:
        return state.origin

    def confidence(self, plan: DecodePlan, drafts, q, state: HybridState):
        """The drafter's calibrated confidences on its rows (past its trained slots, where its rows' drafts are looked
        up too, the lookup's acceptance), the lookup's acceptance by match length on the other rows."""
        copied = match_acceptance(state.match, drafts.shape[1])
        own = self._model_rows(plan, drafts, q, state.drafter, copied)
        return jnp.where(state.origin[:, None] == 1, copied, own)

    def _model_rows(self, plan: DecodePlan, drafts, q, cache: KVCache, copied):
        """[B, k]: the chances of a drafter row's drafts: its calibrated confidences on its trained slots, past them
        (drafts looked up) the lookup's `copied`."""
        own = self.model.confidence(plan, drafts, q, cache)
        return jnp.where(jnp.arange(drafts.shape[1]) < self.model.cfg.num_slots, own, copied)

    def advance(self, plan: DecodePlan, state: HybridState, num_new, next_tokens) -> HybridState:
        return HybridState(self.model.advance(plan, state.drafter, num_new, next_tokens),
                           state.history.grow(num_new, next_tokens), state.origin, state.match)
