"""`DecodePlan`: the static options of the engine's compiled functions (a change in any of them is another
compilation), and the matmul precision they imply. What drafts and what accepts come apart, as values the
functions are given (draft_source.py, speculative.Verify); how many rounds a chunk runs is the chunk's own argument."""

from __future__ import annotations

import dataclasses

import jax

from specformer_jax.config import TargetConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    cfg: TargetConfig
    eos_ids: tuple[int, ...]
    sampling: SamplingConfig
    max_new_tokens: int  # N: the widest budget, the width of every row's output buffer
    draft_len: int = 0  # k: drafts per round (0: plain decoding)
    stop_early: bool = False  # a chunk ends after the round in which a row finished (chunk.py; CPUs)

    @property
    def speculative(self) -> bool:
        return self.draft_len > 0

    @property
    def precision(self) -> str | None:
        """float32 models decode with float32 matmuls everywhere. GPUs would otherwise round them to TF32 and TPUs
        to bfloat16 passes; a verify forward over k + 1 tokens and a one-token step are then rounded differently,
        near-ties of the greedy argmax flip, and speculative output drifts from plain output."""
        return "highest" if self.cfg.dtype == "float32" else None


def make_plan(model, draft_len: int, sampling: SamplingConfig, max_new_tokens: int) -> DecodePlan:
    """The plan for decoding with `model` (a LoadedTarget) with draft_len drafts per round (0: plain decoding); its
    chunks stop early on a CPU, where a data-dependent loop costs no wait for a device."""
    return DecodePlan(model.cfg, model.eos_ids, sampling, max_new_tokens, draft_len,
                      stop_early=jax.default_backend() == "cpu")
