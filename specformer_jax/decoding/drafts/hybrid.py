"""The hybrid draft source (`--drafter default+ngram`, `DIR+ngram`): every round both the SpecFormer drafter and
the n-gram lookup propose; each row takes the n-gram drafts when its match is at least `min_match` tokens long, else
the drafter's. One verify pass serves the whole batch, and each row is verified against the q it drew from (a point
mass for n-gram drafts), so output stays lossless, greedy or sampled.

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
from specformer_jax.decoding.drafts.ngram import NgramDrafts, TokenHistory, lookup, point_mass
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.defaults import HYBRID_MIN_MATCH, NGRAM_DRAFT_CONFIDENCE
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

    def write_rows(self, new: "HybridState", slots, lens, Tp: int) -> "HybridState":
        return HybridState(self.drafter.write_rows(new.drafter, slots, lens, Tp),
                           self.history.write_rows(new.history, slots, lens, Tp),
                           self.origin.at[slots].set(new.origin, mode="drop"))


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
        return HybridState(self.model.empty_state(plan, rows, max_len), TokenHistory.zeros(rows, max_len),
                           jnp.zeros((rows,), jnp.int32))

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
        use = n >= self.min_match
        drafts = jnp.where(use[:, None], looked_up, own)
        q = jnp.where(use[:, None, None], q_looked_up, q_own)
        return drafts, q, HybridState(cache, history, use.astype(jnp.int32))

    def origin(self, state: HybridState) -> jax.Array:
        return state.origin

    def confidence(self, plan: DecodePlan, drafts, q, state: HybridState):
        """The drafter's top probabilities on its rows (the n-gram prior past its trained slots, where its rows'
        drafts are looked up too), the n-gram prior on the other rows."""
        own = self.model.confidence(plan, drafts, q, state.drafter)
        own = jnp.where(jnp.arange(drafts.shape[1]) < self.model.cfg.num_slots, own, NGRAM_DRAFT_CONFIDENCE)
        return jnp.where(state.origin[:, None] == 1, NGRAM_DRAFT_CONFIDENCE, own)

    def advance(self, plan: DecodePlan, state: HybridState, num_new, next_tokens) -> HybridState:
        return HybridState(self.model.advance(plan, state.drafter, num_new, next_tokens),
                           state.history.grow(num_new, next_tokens), state.origin)
