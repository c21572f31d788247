"""What the commands share: the parser that reports a bad option in one line, argparse types built on checks.py
(so an option and the matching Python argument are checked alike), output paths probed before any work, and the
options several commands take."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pallas_kernels import IMPLS
from specformer_jax import defaults
from specformer_jax.assets import SHIPPED_DRAFTERS
from specformer_jax.checks import FRACTION, NON_NEGATIVE_INT, POSITIVE_INT, Kind
from specformer_jax.errors import SpecformerError
from specformer_jax.files import probe_writable

SHIPPED_NAMES = ", ".join(repr(name) for name in SHIPPED_DRAFTERS)  # quoted, for help texts


# what float() reads as a negative number, alone or first in a list (1,8,64): argparse's own pattern misses -inf,
# -nan, -1e5 and -1,5, so "--temperature -inf" was read as an unknown option ("expected one argument") instead of
# reaching the option's type check
_NUMBER = r"(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(e[-+]?\d[\d_]*)?|inf|infinity|nan"
NEGATIVE_NUMBER = re.compile(rf"^-({_NUMBER})(,-?({_NUMBER}))*$", re.I)


class Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors, no abbreviated options (`--max-new-token` would be read as
    `--max-new-tokens`, and profile-round's `--draft-len` as `--draft-lens`) and every negative number a value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})
        self._negative_number_matcher = NEGATIVE_NUMBER

    def error(self, message):  # one line, not usage + traceback
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def kind(k: Kind):
    """An argparse type reading its text as `k` ("expected a positive integer, got '0'")."""

    def parse(text: str):
        try:
            return k.parse(text)
        except SpecformerError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def out_file(text: str) -> Path:
    """An output file's path, refused before any work when it could not be written."""
    return _probed(text, directory=False)


def out_dir(text: str) -> Path:
    """An output directory's path, refused before any work when it could not be made or written."""
    return _probed(text, directory=True)


def _probed(text: str, directory: bool) -> Path:
    try:
        return probe_writable(Path(text), directory)
    except SpecformerError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list(name: str, from_zero: bool = False, like: str = "1,8,64"):
    """Comma-separated distinct positive integers, e.g. 1,8,64 (each a row or a run of the result: one twice would be
    measured twice); `from_zero`: non-negative ones (indices)."""
    kind, what = (NON_NEGATIVE_INT, "integers from 0") if from_zero else (POSITIVE_INT, "positive integers")

    def parse(text: str) -> list[int]:
        try:
            values = [kind.parse(x) for x in text.split(",")]
        except SpecformerError:
            raise argparse.ArgumentTypeError(f"{name} expects {what} like {like}, got {text!r}") from None
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{name} lists {', '.join(map(str, twice))} more than once")
        return values

    return parse


def add_model(p) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a HF checkpoint dir, a .gguf file, or random:NAME (random "
                        "weights of a published shape, bfloat16: tiny, smollm2-135m, llama-3.2-1b, qwen3-4b, "
                        "llama-3.1-8b; for speed, with --set-acceptance)")


def add_device_options(p) -> None:
    """--attention-impl and --mesh: how decoding runs on the devices."""
    p.add_argument("--attention-impl", choices=IMPLS, default="auto",
                   help="attention kernels: auto = Pallas on GPU/TPU, on a CPU the C++ kernel (the jnp reference "
                        "where it cannot be built)")
    p.add_argument("--mesh", default=None,
                   help="shard decoding over devices, e.g. data=4,tensor=2 (rows over data, the model over tensor)")


def rate_list(name: str):
    """Comma-separated numbers in [0, 1], e.g. 0.5,0.7,0.8."""

    def parse(text: str) -> list[float]:
        try:
            values = [float(FRACTION.parse(x)) for x in text.split(",")]
        except SpecformerError:
            raise argparse.ArgumentTypeError(f"{name} expects numbers in [0, 1] like 0.5,0.7, got {text!r}") from None
        return list(dict.fromkeys(values))

    return parse


def add_engine_options(p, schedules: tuple[str, ...] = ("continuous", "static")) -> None:
    """--schedule and --chunk-rounds: how the engine runs requests (docs/decoding.md)."""
    p.add_argument("--schedule", choices=schedules, default="continuous",
                   help="continuous (default): a finished request's slot is refilled from the queue at once; static: "
                        "batches of --batch-size prompts, each run until its slowest row is done"
                        + ("; both: each side under both, in one run" if "both" in schedules else ""))
    p.add_argument("--chunk-rounds", type=kind(POSITIVE_INT), default=None,
                   help=f"rounds the device runs between two looks of the host (default {defaults.CHUNK_ROUNDS})")


def mesh(args):
    """The mesh of --mesh, or None."""
    from specformer_jax.parallel import make_mesh

    return make_mesh(args.mesh) if args.mesh else None


def records():
    """The decoding records the CLI reads and writes (SPECFORMER_CACHE/decode_records.json)."""
    from specformer_jax.decoding.tuning.records import DecodeRecords

    return DecodeRecords.default()


def drafter_needed(drafter, draft_len, hint: str) -> None:
    """Refuse --draft-len k > 0 or auto when there is no drafter."""
    if drafter is None and draft_len not in (None, 0):
        raise SpecformerError(f"--draft-len {draft_len} needs a drafter{hint}")
