"""Drafter strings: the one reader of every drafter a user names, on the command line (`--drafter` of each command,
`average-drafters --drafters`, the training setting `init_from`), in the benchmark scripts and in Python
(`generate(drafter="...")`, `resolve_drafter`), so that each takes the same strings and refuses the same ones with
the same line.

    default           the drafter shipped for the default model (v14); with a random-weight target (random:NAME),
                      random weights, as no drafter was trained for those
    v14               the shipped drafter by name (the package ships one; earlier ones, v4 to v12, are restored from
                      the repository's history by `bash history/restore.sh NAME` and given as directories)
    DIR               a drafter directory (drafter.json and params.safetensors); one that shares a name: ./NAME
    ngram             the n-gram lookup in each row's prompt and answer so far (n from 4 down to 1; any model)
    ngram:MIN-MAX     the same, n from MAX down to MIN
    X+ngram           the hybrid (X one of the SpecFormer drafters here): per row the drafts expected to have more
                      accepted (the lookup's by match length, at least defaults.HYBRID_MIN_MATCH tokens; the drafter's
                      by its confidence)
    random            a drafter of fresh random weights (RANDOM_DRAFTER's shape): what a drafter costs, for speed
    none              no drafter: plain decoding

`read_drafter` reads a string without a model, so that a bad one is refused before any model loads; the DrafterName
it returns loads the drafter for a target; `resolve_drafter` does both.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from specformer_jax.assets import DEFAULT_DRAFTER, HISTORY_DRAFTERS, SHIPPED_DRAFTERS
from specformer_jax.checkpoints.drafter_io import drafter_dir, load_drafter, random_drafter
from specformer_jax.checkpoints.random_weights import is_random
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.kinds import Drafter
from specformer_jax.decoding.drafts.ngram import NgramDrafts
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.loaded import LoadedTarget, checked_target

SPECFORMER = f"default, {', '.join(SHIPPED_DRAFTERS)}, a drafter directory or random"  # what has weights
NAMES = (f"default, {', '.join(SHIPPED_DRAFTERS)}, a drafter directory, ngram, ngram:MIN-MAX, DRAFTER+ngram, random "
         "or none")
NGRAM = re.compile(r"ngram:([0-9]+)-([0-9]+)")  # ASCII digits: str.isdigit() also takes '²', which int() refuses


@dataclasses.dataclass(frozen=True)
class DrafterName:
    """What a drafter string names, read without a model: a SpecFormer drafter (`model`: "default", "random" or a
    drafter directory), the n-gram lookup (`ngram`), both (a hybrid) or neither ("none": plain decoding)."""

    text: str  # as given
    model: str | Path | None = None
    ngram: NgramDrafts | None = None

    @property
    def none(self) -> bool:
        return self.model is None and self.ngram is None

    @property
    def directory(self) -> Path | None:
        """The drafter directory this names (None: random weights, or no SpecFormer drafter)."""
        return DEFAULT_DRAFTER if self.model == "default" else self.model if isinstance(self.model, Path) else None

    def on(self, target_source: str) -> DrafterName:
        """This name for the target loaded from `target_source` (what load_target took; LoadedTarget.source):
        "default" with random weights (random:NAME) is "random", as no drafter was trained for them."""
        if self.model != "default" or not is_random(str(target_source)):
            return self
        return DrafterName(self.text.replace("default", "random", 1), "random", self.ngram)

    def specformer(self, what: str) -> DrafterName:
        """This name when it names a SpecFormer drafter alone (`what` reads its weights), else one line."""
        if self.model is None or self.ngram is not None:
            raise SpecformerError(f"{what} takes a SpecFormer drafter ({SPECFORMER}), got {self.text!r}")
        return self

    def load(self, target: LoadedTarget) -> Drafter | None:
        """The drafter this names, for `target` (None: "none"); a SpecFormer drafter made for another target is
        refused in one line."""
        name = self.on(checked_target(target, "target").source)
        if name.model is None:
            return name.ngram
        model = random_drafter(target) if name.model == "random" else load_drafter(name.directory, target)
        return model if name.ngram is None else Hybrid(model, name.ngram)


def resolve_drafter(spec: str | os.PathLike, target: LoadedTarget) -> Drafter | None:
    """The drafter a string names, loaded for `target`: "default" (the shipped drafter; random weights for a
    random-weight target), "v14", a drafter directory, "ngram" or "ngram:MIN-MAX", "X+ngram" (a hybrid of X, one of
    the SpecFormer drafters before, and the n-gram lookup), "random" (fresh random weights) or "none" (None: plain
    decoding). A path-like object is a directory. What `generate(drafter="...")` and every `--drafter` take; a
    string that names nothing is one line (SpecformerError), the same from the CLI."""
    return read_drafter(spec).load(target)


def read_drafter(spec: str | os.PathLike) -> DrafterName:
    """What `spec` names, read without a model: its syntax checked, a name known, a directory found (so a bad string
    is refused before any model loads)."""
    if isinstance(spec, os.PathLike):  # a path is a directory, never a name
        return DrafterName(str(spec), drafter_dir(spec))
    if not isinstance(spec, str):
        raise SpecformerError(f"a drafter is named by text ({NAMES}), got {type(spec).__name__} {spec!r:.60}")
    if not spec.strip():
        raise SpecformerError(f"the drafter is empty: give {NAMES}")
    if spec == "none":
        return DrafterName(spec)
    base, plus, last = spec.rpartition("+")
    if plus and last.startswith("ngram"):
        if not base or base == "none" or base.rpartition("+")[2].startswith("ngram"):  # ngram+ngram, X+ngram+ngram
            raise SpecformerError(f"a hybrid drafter is DRAFTER+ngram, DRAFTER one of {SPECFORMER} (e.g. "
                                  f"default+ngram), got {spec!r}")
        return DrafterName(spec, _model(base), _ngram(last))
    if spec.startswith("ngram"):
        return DrafterName(spec, ngram=_ngram(spec))
    return DrafterName(spec, _model(spec))


def implied_drafter(model: str) -> DrafterName:
    """The drafter of a `generate` that names none: the shipped one with the default model (where this installation
    has it), else none."""
    shipped = model == "default" and (DEFAULT_DRAFTER / "drafter.json").is_file()
    return read_drafter("default" if shipped else "none")


def _ngram(text: str) -> NgramDrafts:
    """`ngram` (n from 4 down to 1) or `ngram:MIN-MAX`, e.g. ngram:2-5 (NgramDrafts checks the values)."""
    if text == "ngram":
        return NgramDrafts()
    match = NGRAM.fullmatch(text)
    if match is None:
        raise SpecformerError(f"an n-gram drafter is 'ngram' or 'ngram:MIN-MAX' (e.g. ngram:2-5), got {text!r}")
    return NgramDrafts(max_n=int(match[2]), min_n=int(match[1]))


def _model(text: str) -> str | Path:
    """A SpecFormer drafter's part of a drafter string: "default", "random", the shipped drafter's directory, or a
    drafter directory; a drafter of the repository's history is refused with how to restore it."""
    if text == "default" or text in SHIPPED_DRAFTERS:
        path = SHIPPED_DRAFTERS.get(text, DEFAULT_DRAFTER)
        if not (path / "drafter.json").is_file():
            raise SpecformerError(f"this installation does not ship the drafter {text}; pass a drafter directory")
        return text if text == "default" else path
    if text == "random":
        return text
    if text in HISTORY_DRAFTERS:
        raise SpecformerError(f"drafter {text!r} is not shipped with the package (only {', '.join(SHIPPED_DRAFTERS)} "
                              f"is): restore it with 'bash history/restore.sh {text}' and pass its directory, "
                              f"history/drafters/{text}")
    if not Path(text).expanduser().exists():
        raise SpecformerError(f"drafter {text!r} does not exist: give {NAMES}")
    return drafter_dir(text)
