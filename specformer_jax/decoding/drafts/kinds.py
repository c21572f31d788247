"""What a user may draft with, and the draft source each one runs as: a SpecFormer drafter (`LoadedDrafter`), the
n-gram lookup (`NgramDrafts`, `--drafter ngram`) or both chosen per row (`Hybrid`, `--drafter default+ngram`).
`generate`, `bench` and the tuner ask here how far each may draft and how far it drafts by default."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.drafts.hybrid import Hybrid, HybridDrafts
from specformer_jax.decoding.drafts.ngram import MAX_NGRAM_DRAFTS, NgramDrafts
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import drafter_axes
from specformer_jax.modeling.loaded import LoadedDrafter, check_drafter_fits
from specformer_jax.parallel import param_shardings

Drafter = LoadedDrafter | NgramDrafts | Hybrid

# Drafts per round by pool size on a CPU with its kernels (the target's packed layout), plain decoding beyond: the
# best k measured at each pool size (benchmarks/README.md: "v5 against v4 on the CPU" for the SpecFormer drafter,
# "N-gram drafts" for the others). A round's arithmetic grows with its rows there, so the rounds that pay get shorter
# as the pool grows.
CPU_DRAFT_LENS = {LoadedDrafter: {1: 3, 2: 2}, NgramDrafts: {1: 7, 2: 2}, Hybrid: {1: 7, 2: 4}}
ACCELERATOR_NGRAM_DRAFTS = 4  # n-gram drafts per round by default on a GPU or TPU
# On a CPU a hybrid's rounds with no n-gram row verify only the SpecFormer drafts (chunk.run_chunk). Its drafter drafts
# all its slots anyway, and at batch 1 up to 3 drafts cost no more than one, so there they verify 3; elsewhere as
# many as the drafter alone would (benchmarks/README.md, "N-gram drafts and the hybrid").
HYBRID_CPU_MODEL_DRAFTS = {1: 3}


def checked_drafter(drafter, target_cfg) -> Drafter:
    """The drafter, refused in one line when it is none of the kinds or a SpecFormer drafter for another target."""
    if isinstance(drafter, NgramDrafts):
        return drafter
    check_drafter_fits(drafter.drafter if isinstance(drafter, Hybrid) else drafter, target_cfg)
    return drafter


def max_draft_len(drafter: Drafter) -> int:
    """The most drafts per round: a SpecFormer drafter's trained slots; an n-gram lookup (alone or in a hybrid)
    drafts as far as asked, up to MAX_NGRAM_DRAFTS."""
    return drafter.cfg.num_slots if isinstance(drafter, LoadedDrafter) else MAX_NGRAM_DRAFTS


def default_draft_len(drafter: Drafter, batch_size: int, packed: bool) -> int:
    """Drafts per round when none is asked for, for a pool of `batch_size` rows whose target runs in the layout
    `packed` (TargetConfig.pack_weights: the CPU kernels). On an accelerator: every trained slot of a SpecFormer
    drafter (a hybrid's too), ACCELERATOR_NGRAM_DRAFTS for the lookup alone. On a CPU with the kernels,
    CPU_DRAFT_LENS (0, plain decoding, for larger pools); on a CPU without them (XLA's matmuls: a bfloat16 model, a
    mesh, no compiler), one, since each further row there costs nearly a row's reading of the weights."""
    if jax.default_backend() != "cpu":
        if isinstance(drafter, NgramDrafts):
            return ACCELERATOR_NGRAM_DRAFTS
        return specformer_part(drafter).cfg.num_slots
    k = CPU_DRAFT_LENS[type(drafter)].get(batch_size, 0) if packed else 1
    return min(max_draft_len(drafter), k)


def draft_source(drafter: Drafter, mesh: Mesh | None, target_cfg, batch_size: int):
    """The source the engine drafts with for a pool of `batch_size` rows (a SpecFormer drafter's parameters sharded
    over `mesh` by their logical axes)."""
    if isinstance(drafter, NgramDrafts):
        return drafter
    loaded = specformer_part(drafter)
    params = loaded.params
    if mesh is not None:
        params = jax.device_put(params, param_shardings(params, drafter_axes(target_cfg, loaded.cfg), mesh))
    model = SpecformerDrafts(loaded.cfg, params)
    if not isinstance(drafter, Hybrid):
        return model
    return HybridDrafts(model, drafter.ngram, drafter.min_match, hybrid_model_len(loaded, batch_size, target_cfg))


def hybrid_model_len(loaded: LoadedDrafter, batch_size: int, target_cfg) -> int:
    """Drafts a hybrid's round verifies when no live row has n-gram drafts (at least one). Only a CPU narrows rounds
    (chunk.chunk_widths); elsewhere every round verifies all k."""
    alone = max(1, default_draft_len(loaded, batch_size, target_cfg.pack_weights))
    if jax.default_backend() != "cpu" or not target_cfg.pack_weights:
        return alone
    return min(loaded.cfg.num_slots, HYBRID_CPU_MODEL_DRAFTS.get(batch_size, alone))  # alone is within the slots


def specformer_only(drafter, what: str) -> LoadedDrafter:
    """The SpecFormer drafter of `what` (a feature that reads a drafter's measured acceptance), refused in one line
    for the n-gram lookup and hybrids."""
    if not isinstance(drafter, LoadedDrafter):
        raise SpecformerError(f"{what} needs a SpecFormer drafter alone (its measured acceptance); for ngram and "
                              "hybrid drafters give a number of drafts per round")
    return drafter


def specformer_part(drafter: Drafter | None) -> LoadedDrafter | None:
    """The SpecFormer drafter a drafter runs (a hybrid's own), or None (the n-gram lookup, or no drafter)."""
    return drafter.drafter if isinstance(drafter, Hybrid) else drafter if isinstance(drafter, LoadedDrafter) else None
