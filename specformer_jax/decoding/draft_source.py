"""Draft sources: what a speculative round drafts with. A source is a pytree the engine's compiled functions are
given (its settings static, its parameters data), so a new source is a new class here, not branches in the round.

A source answers four things (`SpecformerDrafts` is the model; tests give oracles of the same shape):

  hooks(plan)        the target hidden states it reads from the round's forward
  empty_state(plan, rows, max_len)   its per-row state (a KV cache whose lengths move with the target's, or None)
  bind(plan, params) itself with what it derives from the target's parameters, once per call (scheduler.py)
  draft(plan, hidden, state, num_new, slots_at, next_tokens, keys)
                     -> (drafts int32[B, k], q float32[B, k, V] (greedy: [B, k, 1]), state): plan.draft_len drafts
                     from position slots_at[b, 0] of the T new tokens; the state grows by num_new[b] positions;
                     next_tokens [B, T]: the token after each new position (exact up to slots_at).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.plan import DecodePlan
from specformer_jax.decoding.speculative import choose_drafts
from specformer_jax.modeling.drafter import (
    Drafter,
    DrafterParams,
    DraftHead,
    apply_drafter,
    draft_head,
    draft_logits,
    drafter_cache,
    next_token_embedding,
)
from specformer_jax.modeling.kv_cache import KVCache


@struct.dataclass
class SpecformerDrafts:
    """Drafts from a SpecFormer drafter: its first k slots at the row's last accepted position, over its draft
    vocabulary (mapped to token ids), through the target's own final norm and LM head."""

    cfg: DrafterConfig = struct.field(pytree_node=False)
    params: DrafterParams
    head: DraftHead | None = None  # the target's head for drafting (`bind`)

    def hooks(self, plan: DecodePlan) -> tuple[int, ...]:
        return self.cfg.resolved_hooks(plan.cfg)

    def empty_state(self, plan: DecodePlan, rows: int, max_len: int) -> KVCache:
        return drafter_cache(plan.cfg, rows, max_len)

    def bind(self, plan: DecodePlan, target_params) -> "SpecformerDrafts":
        return self.replace(head=draft_head(plan.cfg, target_params, self.params.vocab))

    def draft(self, plan: DecodePlan, hidden, state: KVCache, num_new, slots_at, next_tokens, keys):
        h, state, next_embed = self.context(plan, hidden, state, num_new, next_tokens)
        drafts, q = self.choose(plan, self.slots(plan, h, slots_at, next_embed), keys)
        return drafts, q, state

    # The parts of `draft`, which `specformer profile-round` times one by one.
    def context(self, plan: DecodePlan, hidden, state: KVCache, num_new, next_tokens):
        """The drafter's context layer over the round's new positions: ([B, T, d], the state grown by num_new, the
        embeddings of next_tokens when the drafter reads them, else None)."""
        next_embed = next_token_embedding(self.head.params, next_tokens) if self.cfg.reads_next_tokens else None
        h, state = apply_drafter(plan.cfg, self.cfg, self.params, hidden, state, num_new, next_embed,
                                 method=Drafter.context)
        return h, state, next_embed

    def slots(self, plan: DecodePlan, h, slots_at, next_embed):
        """The slot layer at positions slots_at [B, 1] of the context layer's output: [B, k, d]."""
        h = jnp.take_along_axis(h, slots_at[:, :, None], axis=1)
        if next_embed is not None:
            next_embed = jnp.take_along_axis(next_embed, slots_at[:, :, None], axis=1)
        return apply_drafter(plan.cfg, self.cfg, self.params, h, plan.draft_len, next_embed,
                             method=Drafter.slots)[:, 0]

    def choose(self, plan: DecodePlan, slot_states, keys):
        """The draft head over the slots' states and the drafts chosen from it: (drafts [B, k], q)."""
        logits = draft_logits(plan.cfg, self.head, slot_states)  # [B, k, V']
        return choose_drafts(logits, keys, plan.sampling, self.head.vocab, plan.cfg.vocab_size)
