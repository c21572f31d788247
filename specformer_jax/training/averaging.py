"""A drafter whose weights are the mean of several of one shape (a weight average, or "model soup": Wortsman et al.,
arXiv 2203.05482). Drafters fine-tuned from one another lie close enough in weight space that their mean is a drafter
too, and it can accept more than any of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specformer_jax.config import DrafterConfig
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import DrafterParams
from specformer_jax.modeling.loaded import LoadedDrafter


def average_drafters(drafters: Sequence[LoadedDrafter]) -> tuple[DrafterConfig, DrafterParams]:
    """(the last drafter's settings, the drafters' weights averaged in float32 and cast back to the last one's dtypes,
    with the last one's draft vocabulary). The head is the target's, so a drafter's vocabulary only chooses its rows:
    drafters may differ in it, not in any other setting. The CLI asks for two or more."""
    files = [d.sha256 for d in drafters]
    for i, sha in enumerate(files):
        if sha is not None and sha in files[:i]:
            raise SpecformerError(f"drafters {files.index(sha) + 1} and {i + 1} are the same file (params sha256 "
                                  f"{sha[:12]}...): give each drafter once")
    shape = [dataclasses.asdict(dataclasses.replace(d.cfg, draft_vocab_size=None)) for d in drafters]
    for i, cfg in enumerate(shape[1:], 1):
        if cfg != shape[0]:
            diff = ", ".join(f"{name} {shape[0][name]} against {value}" for name, value in cfg.items()
                             if value != shape[0][name])
            raise SpecformerError(f"drafter {i + 1}'s settings differ from the first's ({diff}): only drafters of "
                                  "one shape can be averaged")
    last = drafters[-1]
    total = jax.tree.map(lambda *ws: sum(w.astype(jnp.float32) for w in ws), *(d.params.weights for d in drafters))
    weights = jax.tree.map(lambda t, w: (t / len(drafters)).astype(w.dtype), total, last.params.weights)
    return last.cfg, DrafterParams(weights, last.params.vocab)
