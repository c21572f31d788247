"""Draft sources: what a speculative round drafts with. A source is a pytree the engine's compiled functions are
given (its settings static, its parameters data), so a new source is a new class here, not branches in the round.

A source answers these (`SpecformerDrafts` is the model, ngram.py and hybrid.py hold the others; tests give
oracles of the same shape):

  hooks(plan)        the target hidden states it reads from the round's forward
  empty_state(plan, rows, max_len)   its per-row state, whose lengths move with the target cache's (a KV cache, a
                     token history): a pytree with `write_rows(new, slots, lens, Tp)` for the prefill
  bind(plan, params) itself with what it derives from the target's parameters (and its own weights in the
                     target's layout), once per call (scheduler.py)
  draft(plan, hidden, state, num_new, slots_at, next_tokens, keys)
                     -> (drafts int32[B, k], q float32[B, k, V] (greedy: [B, k, 1]), state): plan.draft_len drafts
                     from position slots_at[b, 0] of the T new tokens; the state grows by num_new[b] positions;
                     next_tokens [B, T]: the token after each new position (exact up to slots_at).
  advance(plan, state, num_new, next_tokens)
                     the state grown by num_new[b] positions without drafting (a plain step on a speculative pool,
                     chunk.run_plain_chunk); what it leaves unwritten makes later drafts worse, never wrong
  origins            names of what its drafts can come from (one name, or several for a hybrid: stats per origin)
  origin(state)      int32[B]: which origin made each row's latest drafts (None: the first, for one-origin sources)
  confidence(plan, drafts, q, state)
                     float32[B, k]: each draft's chance of acceptance given the drafts before it, what a round with
                     a budget ranks drafts by (engine/budget.py)
  widths(plan)       per origin, how many of its k drafts a round verifies (a round verifies the most any live row
                     needs, on a CPU: chunk.run_chunk)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.speculative import choose_drafts, draft_confidence
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.modeling.calibration import calibrated
from specformer_jax.modeling.drafter import (
    Drafter,
    DrafterParams,
    DraftHead,
    apply_drafter,
    draft_head,
    draft_logits,
    drafter_cache,
    next_token_embedding,
    pack_drafter,
)
from specformer_jax.modeling.kv_cache import KVCache


@struct.dataclass
class SpecformerDrafts:
    """Drafts from a SpecFormer drafter: its first k slots at the row's last accepted position, over its draft
    vocabulary (mapped to token ids), through the target's own final norm and LM head."""

    cfg: DrafterConfig = struct.field(pytree_node=False)
    params: DrafterParams
    head: DraftHead | None = None  # the target's head for drafting (`bind`)
    packed: bool = struct.field(pytree_node=False, default=False)  # weights packed for the CPU kernels (`bind`)
    calibration: jax.Array | None = None  # float32[K, GRID]: confidence -> acceptance (modeling/calibration.py)

    origins = ("specformer",)

    def hooks(self, plan: DecodePlan) -> tuple[int, ...]:
        return self.cfg.resolved_hooks(plan.cfg)

    def widths(self, plan: DecodePlan) -> tuple[int, ...]:
        return (plan.draft_len,)

    def empty_state(self, plan: DecodePlan, rows: int, max_len: int) -> KVCache:
        return drafter_cache(plan.cfg, rows, max_len)

    def bind(self, plan: DecodePlan, target_params) -> "SpecformerDrafts":
        """With the target's head for drafting and, where the target decodes in its packed CPU layout, the drafter's
        weights packed alike (`pack_drafter`)."""
        params, pack = self.params, plan.cfg.pack_weights and not self.packed
        if pack:
            params = params.replace(weights=pack_drafter(params.weights))
        return self.replace(head=draft_head(plan.cfg, target_params, params.vocab), params=params,
                            packed=self.packed or pack)

    def draft(self, plan: DecodePlan, hidden, state: KVCache, num_new, slots_at, next_tokens, keys):
        h, state, next_embed = self.context(plan, hidden, state, num_new, next_tokens)
        drafts, q = self.choose(plan, self.slots(plan, h, slots_at, next_embed), keys)
        return drafts, q, state

    def origin(self, state: KVCache) -> None:
        return None

    def confidence(self, plan: DecodePlan, drafts, q, state: KVCache):
        """The drafter's top probability at each slot (`draft_confidence`), through its calibration when it has one:
        the chance, measured on held-out data, that a draft so confident is accepted after the drafts before it."""
        return calibrated(draft_confidence(q), self.calibration)

    def advance(self, plan: DecodePlan, state: KVCache, num_new, next_tokens) -> KVCache:
        """Only the lengths move: the context layer's cost is saved, and the positions it skips keep what they held
        (the row's later drafts attend to them as they are; verification keeps the output exact)."""
        return state.replace(lengths=state.lengths + num_new)

    # The parts of `draft`, which `specformer profile-round` times one by one.
    def context(self, plan: DecodePlan, hidden, state: KVCache, num_new, next_tokens):
        """The drafter's context layer over the round's new positions: ([B, T, d], the state grown by num_new, the
        embeddings of next_tokens when the drafter reads them, else None)."""
        next_embed = next_token_embedding(self.head.params, next_tokens) if self.cfg.reads_next_tokens else None
        h, state = apply_drafter(plan.cfg, self.cfg, self.params, hidden, state, num_new, next_embed,
                                 packed=self.packed, method=Drafter.context)
        return h, state, next_embed

    def slots(self, plan: DecodePlan, h, slots_at, next_embed):
        """The slot layer at positions slots_at [B, 1] of the context layer's output: [B, k, d]."""
        h = jnp.take_along_axis(h, slots_at[:, :, None], axis=1)
        if next_embed is not None:
            next_embed = jnp.take_along_axis(next_embed, slots_at[:, :, None], axis=1)
        return apply_drafter(plan.cfg, self.cfg, self.params, h, plan.draft_len, next_embed, packed=self.packed,
                             method=Drafter.slots)[:, 0]

    def choose(self, plan: DecodePlan, slot_states, keys):
        """The draft head over the slots' states and the drafts chosen from it: (drafts [B, k], q)."""
        logits = draft_logits(plan.cfg, self.head, slot_states)  # [B, k, V']
        return choose_drafts(logits, keys, plan.sampling, self.head.vocab, plan.cfg.vocab_size)
