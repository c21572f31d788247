"""What a user may draft with, and the draft source each one runs as: a SpecFormer drafter (`LoadedDrafter`), the
n-gram lookup (`NgramDrafts`, `--drafter ngram`) or both chosen per row (`Hybrid`, `--drafter default+ngram`).
Each kind has a name ("specformer", "ngram", "hybrid") by which specformer_jax/defaults.py's tables list its measured
default draft lengths; `generate`, `bench` and the tuner ask here how far each may draft."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.drafts.hybrid import Hybrid, HybridDrafts
from specformer_jax.decoding.drafts.ngram import MAX_NGRAM_DRAFTS, NgramDrafts
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.calibration import drafter_table
from specformer_jax.modeling.drafter import drafter_axes
from specformer_jax.modeling.loaded import LoadedDrafter, check_drafter_fits
from specformer_jax.parallel import param_shardings

Drafter = LoadedDrafter | NgramDrafts | Hybrid
KIND_NAMES = {LoadedDrafter: "specformer", NgramDrafts: "ngram", Hybrid: "hybrid"}


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


def kind_name(drafter: Drafter) -> str:
    """The kind's name in the tables of defaults.py ("specformer", "ngram", "hybrid")."""
    return KIND_NAMES.get(type(drafter), type(drafter).__name__)


def draft_source(drafter: Drafter, mesh: Mesh | None, target_cfg, model_len: int | None):
    """The source the engine drafts with (a SpecFormer drafter's parameters sharded over `mesh` by their logical
    axes). `model_len`: for a hybrid, the drafts its rounds verify when no row has n-gram drafts
    (draft_len.hybrid_model_len); unused by the other kinds."""
    if isinstance(drafter, NgramDrafts):
        return drafter
    loaded = specformer_part(drafter)
    params = loaded.params
    if mesh is not None:
        params = jax.device_put(params, param_shardings(params, drafter_axes(target_cfg, loaded.cfg), mesh))
    table = drafter_table(loaded.meta, loaded.cfg.num_slots)
    model = SpecformerDrafts(loaded.cfg, params, calibration=None if table is None else jnp.asarray(table))
    if not isinstance(drafter, Hybrid):
        return model
    return HybridDrafts(model, drafter.ngram, drafter.min_match, model_len)


def specformer_only(drafter, what: str) -> LoadedDrafter:
    """The SpecFormer drafter of `what` (a feature that reads a drafter's measured acceptance), refused in one line
    for the n-gram lookup and hybrids."""
    if not isinstance(drafter, LoadedDrafter):
        raise SpecformerError(f"{what} needs a SpecFormer drafter alone (it measures that drafter); for ngram and "
                              "hybrid drafters give a number instead")
    return drafter


def specformer_part(drafter: Drafter | None) -> LoadedDrafter | None:
    """The SpecFormer drafter a drafter runs (a hybrid's own), or None (the n-gram lookup, or no drafter)."""
    return drafter.drafter if isinstance(drafter, Hybrid) else drafter if isinstance(drafter, LoadedDrafter) else None
