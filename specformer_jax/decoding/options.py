"""`DecodeOptions`: how `generate` and `generate_stream` decode, one frozen value for both. Each takes it as
`options=` or its fields as keywords (`decode_options` makes the one from the other). What can be checked without
the model is checked when the value is made, in one line each; the drafter, the draft length and the mesh are
checked by api.py against the model."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from specformer_jax import defaults
from specformer_jax.checks import FRACTION, POSITIVE_INT, SEED, Kind, checked_budget, integer
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.engine.scheduler import SCHEDULES
from specformer_jax.decoding.tuning.records import DecodeRecords
from specformer_jax.errors import SpecformerError

BOOL = Kind("True or False", lambda v: isinstance(v, bool), bool)  # "False" or 0 is not a switch's value
CACHE_LEN = integer(1, what="a positive integer or None (the model's context length)")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """How `generate` and `generate_stream` decode (each takes `options=DecodeOptions(...)`, or these fields as
    keywords).

    `max_new_tokens`: the answer's budget. `temperature` (0: greedy), `top_k` (0: off), `top_p`, `seed`: sampling;
    a prompt's samples depend on the seed and its index, not on its batch. `batch_size`: slots of the pool (rows
    decoded at once). `chat`: text prompts go through the chat template (True or False). `max_cache_len`:
    positions a row may use (None: the model's context length). `progress`: a progress bar on stderr.

    `drafter`: a drafter's name, as `--drafter` takes it ("default", "v14", a drafter directory, "ngram" or
    "ngram:MIN-MAX", "default+ngram", "random", "none": resolve_drafter, decoding/names.py), or a drafter value: a
    LoadedDrafter (load_drafter), the n-gram lookup (NgramDrafts: any model, no training) or a Hybrid of both (per
    row the n-gram drafts or the drafter's); None: plain decoding. `draft_len`: drafts per round, at most a
    SpecFormer drafter's trained slots (16 for the n-gram lookup and hybrids; 0: plain decoding), or "auto" (an
    AutoDraftLen reading and keeping `records`) or an AutoDraftLen tuner: chosen for this batch size from measured
    costs and acceptance (docs/speculative.md). None: the measured default (specformer_jax/defaults.py),
    DRAFT_LEN_DEFAULTS.

    `schedule`: "continuous" (a finished prompt's slot is refilled from the queue at the next chunk boundary) or
    "static" (batches of `batch_size` prompts, each run until its slowest row is done). `chunk_rounds`: rounds
    (plain steps or speculative rounds) the device runs between two looks of the host, 1..max_new_tokens (None:
    CHUNK_ROUNDS_DEFAULT). `mesh` (specformer_jax.parallel.make_mesh, or its spec such as "data=4,tensor=2"): rows
    sharded over its batch axes, the model by its weights' logical axes; batch_size is rounded up to a multiple of
    the batch axes. `records`: a DecodeRecords store that the call's measured acceptance (and a static schedule's
    batch rounds) are folded into: what "auto" learns from. None: the call records nothing, so it does not change a
    later choice. `set_acceptance` (a rate in [0, 1], speculative decoding with a fixed draft_len): every round runs
    as usual, but each draft is accepted with this probability when the ones before it were, instead of when the
    target agrees: the text is meaningless, the cost is that of a drafter with this acceptance (set_acceptance.py).
    Such a call records nothing. `verify_budget`: positions a speculative round verifies over the whole pool, at
    least the pool's rows (an int, or "+N": the pool's rows plus N): every live row's last token, then the drafts
    most likely to be accepted across rows (docs/decoding.md, "The verify budget"); 0: every row verifies all its
    drafts; None: the measured default with the default draft length, 0 with a draft length given.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    chat: bool = True
    max_cache_len: int | None = None
    progress: bool = False
    drafter: Any = None  # kinds.Drafter, a drafter's name, or None
    draft_len: Any = None  # an int, "auto", an AutoDraftLen, or None
    schedule: str = "continuous"
    chunk_rounds: int | None = None
    mesh: Any = None  # a jax.sharding.Mesh, its spec, or None
    records: DecodeRecords | None = None
    set_acceptance: float | None = None
    verify_budget: int | str | None = None  # positions, or "+N": the batch size plus N

    def __post_init__(self):
        checked = {"max_new_tokens": POSITIVE_INT.check("max_new_tokens", self.max_new_tokens),
                   "batch_size": POSITIVE_INT.check("batch_size", self.batch_size),
                   "seed": SEED.check("seed", self.seed), "chat": BOOL.check("chat", self.chat),
                   "progress": BOOL.check("progress", self.progress)}
        sampling = SamplingConfig(self.temperature, self.top_k, self.top_p)
        checked.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        if self.max_cache_len is not None:
            checked["max_cache_len"] = CACHE_LEN.check("max_cache_len", self.max_cache_len)
        if self.chunk_rounds is not None:  # R > max_new_tokens would only run rounds after every row is done
            checked["chunk_rounds"] = integer(1, checked["max_new_tokens"], "an integer in 1..max_new_tokens = "
                                              f"1..{checked['max_new_tokens']} (every row emits a token a round)"
                                              ).check("chunk_rounds", self.chunk_rounds)
        if self.schedule not in SCHEDULES:
            raise SpecformerError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.records is not None and not isinstance(self.records, DecodeRecords):
            raise SpecformerError(f"records must be a DecodeRecords, got {type(self.records).__name__}")
        if self.set_acceptance is not None:
            checked["set_acceptance"] = FRACTION.check("set_acceptance", self.set_acceptance)
        if self.verify_budget is not None:
            checked["verify_budget"] = checked_budget(self.verify_budget)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(DecodeOptions))
# the docstring states the defaults as defaults.py holds them
DecodeOptions.__doc__ = (DecodeOptions.__doc__.replace("DRAFT_LEN_DEFAULTS", defaults.draft_len_defaults_text())
                         .replace("CHUNK_ROUNDS_DEFAULT", str(defaults.CHUNK_ROUNDS)))


def decode_options(function: str, options: DecodeOptions | None, keywords: dict) -> DecodeOptions:
    """The options of a call to `function`: `options` (None: the defaults) with `keywords` in place of its fields.
    A keyword that is no option is a TypeError, as Python's own for a function, listing the options."""
    unknown = [k for k in keywords if k not in OPTION_NAMES]
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r} (its options: "
                        f"{', '.join(OPTION_NAMES)})")
    if options is not None and not isinstance(options, DecodeOptions):
        raise SpecformerError(f"options must be a DecodeOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **keywords) if options is not None else DecodeOptions(**keywords)


def with_options_signature(function):
    """`function(model, prompts, *, options=None, **keywords)` shown with every option as a keyword of its own (for
    help() and editors), as it accepts them."""
    params = list(inspect.signature(function).parameters.values())[:-1]  # all but **keywords
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
               for f in dataclasses.fields(DecodeOptions)]
    function.__signature__ = inspect.signature(function).replace(parameters=params)
    return function
