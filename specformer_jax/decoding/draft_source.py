"""Draft sources: what a speculative round drafts with. A source is a pytree the engine's compiled functions are
given (its settings static, its parameters data), so a new source is a new class here, not branches in the round.

A source answers four things (`SpecformerDrafts` is the model; tests give oracles of the same shape):

  hooks(plan)        the target hidden states it reads from the round's forward
  empty_state(plan, rows, max_len)   its per-row state (a KV cache whose lengths move with the target's, or None)
  bind(plan, params) itself with what it derives from the target's parameters, once per chunk
  draft(plan, hidden, state, num_new, slots_at, next_tokens, keys)
                     -> (drafts int32[B, k], q float32[B, k, V] (greedy: [B, k, 1]), state): plan.draft_len drafts
                     from position slots_at[b, 0] of the T new tokens; the state grows by num_new[b] positions;
                     next_tokens [B, T]: the token after each new position (exact up to slots_at).
"""

from __future__ import annotations

from flax import struct

from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.plan import DecodePlan
from specformer_jax.decoding.speculative import choose_drafts
from specformer_jax.modeling.drafter import (
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
        next_embed = next_token_embedding(self.head.params, next_tokens) if self.cfg.reads_next_tokens else None
        states, state = apply_drafter(plan.cfg, self.cfg, self.params, hidden, state, num_new, slots_at,
                                      plan.draft_len, next_embed)
        logits = draft_logits(plan.cfg, self.head, states[:, 0])  # [B, k, V']
        drafts, q = choose_drafts(logits, keys, plan.sampling, self.head.vocab, plan.cfg.vocab_size)
        return drafts, q, state
