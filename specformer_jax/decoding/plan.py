"""`DecodePlan`: the static options of the engine's compiled functions (a change in any of them is another
compilation), and what they imply: hooks, the draft function, the matmul precision."""

from __future__ import annotations

import dataclasses

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.decoding.speculative import DraftFn, specformer_drafts

CHUNK_ROUNDS = 8  # rounds per chunk by default (docs/decoding.md, "Chunks")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    cfg: TargetConfig
    eos_ids: tuple[int, ...]
    sampling: SamplingConfig
    max_new_tokens: int  # N: the widest budget, the width of every row's output buffer
    drafter: DrafterConfig | None = None  # None: plain decoding
    draft_len: int = 0  # drafts per round k (1..drafter.num_slots) when speculative, else 0
    chunk_rounds: int = CHUNK_ROUNDS  # R: rounds (plain steps or speculative rounds) per compiled chunk
    drafts_from: DraftFn | None = None  # a draft function in place of the drafter's (tests: oracle drafts)
    set_acceptance: bool = False  # cost measurement: acceptance drawn at the pool's accept_rate, not verified

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.draft_len > 0

    @property
    def hooks(self) -> tuple[int, ...]:
        """The target hidden states the drafter reads (none for plain decoding)."""
        return self.drafter.resolved_hooks(self.cfg) if self.speculative else ()

    def draft_fn(self) -> DraftFn:
        return self.drafts_from or specformer_drafts(self.cfg, self.drafter, self.draft_len)

    @property
    def precision(self) -> str | None:
        """float32 models decode with float32 matmuls everywhere. GPUs would otherwise round them to TF32 and TPUs
        to bfloat16 passes; a verify forward over k + 1 tokens and a one-token step are then rounded differently,
        near-ties of the greedy argmax flip, and speculative output drifts from plain output."""
        return "highest" if self.cfg.dtype == "float32" else None


def make_plan(model, drafter, draft_len: int, sampling: SamplingConfig, max_new_tokens: int,
              chunk_rounds: int = CHUNK_ROUNDS, set_acceptance: bool = False) -> DecodePlan:
    """Plain decoding when there is no drafter or draft_len is 0, else speculative with draft_len drafts. model: a
    LoadedTarget; drafter: a LoadedDrafter or None; set_acceptance: speculative plans only (see
    speculative.set_acceptance; the rate is the pool's, so plans for different rates compile once)."""
    speculative = drafter is not None and draft_len > 0
    return DecodePlan(model.cfg, model.eos_ids, sampling, max_new_tokens, drafter.cfg if speculative else None,
                      draft_len if speculative else 0, chunk_rounds, set_acceptance=set_acceptance and speculative)


