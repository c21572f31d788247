"""`--draft-len auto`: pick the number of drafts per round k (0 = plain decoding) for a batch size on this device.

Cost model. One speculative round with k drafts runs one target forward over k + 1 tokens per row plus the drafter,
and emits E(k) = 1 + c_1 + ... + c_k tokens per row on average, where c_i is the fraction of rounds in which slot i
is accepted (the drafter's `acceptance_rate_per_slot`; a drafter with fewer slots drafts a prefix of the same slots,
so c_i does not depend on k). A plain decoding step emits 1 token. With t_round(B, k) and t_step(B) measured on the
current device at the batch size and cache length at hand,

    predicted speedup(k) = E(k) * t_step(B) / t_round(B, k)

and auto takes the k with the largest predicted speedup, or 0 unless that beats plain decoding by `margin` (15%). At
small batch a round costs little more than a step (weights are read once for all k + 1 tokens), so drafting pays; at
large batch the forward becomes compute bound, t_round grows ~ k + 1, and auto falls back to plain decoding.

A static batch runs until its slowest row is done, and acceptance varies from row to row, so a batch needs more
rounds than E(k) says (on an H100 at batch 64 a predicted 1.13x came out at 0.99x). So every speculative `generate`
call also remembers, per batch size and k, how many plain steps its rows needed against the rounds it ran (the
batch's tokens per round, `batch_accepted_length`). Auto uses that in place of E(k) where it exists, and scales the
E(k) of the other k down as far as the measured batches fell short of their E: a choice that did not pay at a batch
size is not made again there. The margin covers the first call and timing noise.

Measured times are cached on disk per device, model shape, batch size, cache length and version of the decoding code
(a hash of its source), so the measurement (a few compilations) happens once per setup, and again after an upgrade
that may change what a round costs.

Acceptance. Teacher-forced acceptance on the drafter's held-out data (recorded by training or `eval-drafter --save`)
overstates what decoding achieves on other prompts. So every speculative `generate` call folds the acceptance it
measured into a running per-drafter estimate on disk, and auto uses that once it exists (the teacher-forced numbers
only for slots never drafted yet).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import jax
from tqdm import tqdm

import pallas_kernels
from specformer_jax.checkpoints.default import cache_dir
from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.errors import SpecformerError
from specformer_jax.files import write_json

MARGIN = 0.15  # speculative decoding must be predicted at least this much faster to be chosen (see above)


def default_draft_len(drafter: LoadedDrafter) -> int:
    """Drafts per round when none is asked for: every trained slot on an accelerator, one on a CPU. There a matmul over
    a few rows costs several times one row's rather than one read of the weights, so a draft adds to a round about
    what it saves: with the shipped drafters (v3, v4) on 2 cores, one draft a round ran 1.20x plain decoding at
    batch 1 on an idle machine, 1.02x with another process busy on one core, 0.86-1.18x in earlier runs, and four
    drafts 0.71x (benchmarks/results/bench_cpu_quiet.json, bench_cpu_loaded.json, bench_cpu_k1*.json,
    bench_cpu_default*.json, bench_cpu_k4.json)."""
    return 1 if jax.default_backend() == "cpu" else drafter.cfg.num_slots


def drafter_acceptance(drafter: LoadedDrafter) -> list[float]:
    """The drafter's recorded per-slot acceptance (from its training eval or `specformer eval-drafter --save`)."""
    rates = (drafter.meta.get("eval") or {}).get("acceptance_rate_per_slot")
    if not rates or len(rates) != drafter.cfg.num_slots:
        raise SpecformerError("--draft-len auto needs the drafter's measured per-slot acceptance, which it does not "
                              "record: run `specformer eval-drafter --drafter D --data DISTILLED_DIR --save` once")
    return [float(r) for r in rates]


def check_draft_len(drafter: LoadedDrafter, draft_len: int | str | None) -> None:
    """Refuse a draft length this drafter cannot decode with, before any compilation."""
    if draft_len == "auto":
        drafter_acceptance(drafter)
    elif draft_len is not None and not 0 <= draft_len <= drafter.cfg.num_slots:
        raise SpecformerError(f"draft_len must be in 0..{drafter.cfg.num_slots} for this drafter, got {draft_len}")


def expected_tokens(acceptance: list[float], ks) -> dict[int, float]:
    """E(k) = 1 + c_1 + ... + c_k: tokens a row emits per round with k drafts."""
    return {k: 1.0 + sum(acceptance[:k]) for k in ks}


def predicted_speedups(step_seconds: float, round_seconds: dict[int, float],
                       tokens_per_round: dict[int, float]) -> dict[int, float]:
    """speedup(k) = tokens per round(k) * t_step / t_round(k) for every measured k >= 1."""
    return {k: tokens_per_round[k] * step_seconds / t for k, t in sorted(round_seconds.items())}


def choose_draft_len(speedups: dict[int, float], margin: float = MARGIN) -> int:
    """The k with the largest predicted speedup, or 0 (plain decoding) unless it is at least 1 + margin."""
    best = max(speedups, key=speedups.get, default=0)
    return best if best and speedups[best] >= 1.0 + margin else 0


def measure_costs(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
                  new_tokens: int = 64, progress: bool = False) -> dict:
    """t_step (plain decoding) and t_round(k) for k = 1..K, timed on the real decoding loops (greedy, compiled, the
    compilation left out): `batch_size` rows decode `new_tokens` tokens from prompts of cache_len - new_tokens / 2
    tokens, so the cache holds cache_len tokens on average. EOS is switched off so every row runs the whole budget;
    the time per loop iteration then includes everything a round does (verify, acceptance, drafting, bookkeeping).
    The K + 1 loops are compiled concurrently first (`compile_loops`), then timed one after the other."""
    from specformer_jax.decoding.api import compile_loops, generate  # api imports this module

    no_eos = dataclasses.replace(model, eos_ids=())
    prompt_len = max(1, cache_len - new_tokens // 2)
    prompts = [[(31 * i + 7 * r + 1) % model.cfg.vocab_size for i in range(prompt_len)] for r in range(batch_size)]
    ks = range(drafter.cfg.num_slots + 1)
    bar = tqdm(total=2 * len(ks), desc=f"draft-len auto: timing decode loops at batch {batch_size}",
               unit="step", file=sys.stderr, disable=not progress)  # compile each loop, then time it
    with bar:
        compile_loops(no_eos, drafter, prompts, ks, max_new_tokens=new_tokens, batch_size=batch_size,
                      on_compiled=lambda: bar.update())

        def per_iteration(k: int) -> float:
            stats = generate(no_eos, prompts, max_new_tokens=new_tokens, batch_size=batch_size, drafter=drafter,
                             draft_len=k, remember=False).stats
            bar.update()
            return stats["run_seconds"] / max(stats["decode_steps"], 1)

        times = {k: per_iteration(k) for k in ks}
    return {"step_seconds": times.pop(0), "round_seconds": times}


# The code a decoding round runs: its source is part of the cost cache's key.
TIMED_CODE = [Path(__file__).parents[1] / d for d in ("decoding", "modeling")] + [Path(pallas_kernels.__file__).parent]


@functools.cache
def code_fingerprint() -> str:
    h = hashlib.sha256()
    for f in sorted(p for d in TIMED_CODE for p in d.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _cost_key(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int) -> str:
    dev = jax.devices()[0]
    parts = [dev.platform, dev.device_kind, jax.__version__, repr(model.cfg), repr(drafter.cfg), batch_size, cache_len,
             code_fingerprint()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _read_table(path: Path) -> dict:
    """One of the JSON tables kept under SPECFORMER_CACHE; empty when missing, unreadable or not an object. Readers
    treat a damaged entry (edited by hand) as absent, so it is measured or learned again."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def measured_costs(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
                   progress: bool = False) -> dict:
    """measure_costs, cached on disk (SPECFORMER_CACHE/step_costs.json)."""
    path = cache_dir() / "step_costs.json"
    key = _cost_key(model, drafter, batch_size, cache_len)
    table = _read_table(path)
    try:
        c = table[key]
        return {"step_seconds": float(c["step_seconds"]),
                "round_seconds": {int(k): float(v) for k, v in c["round_seconds"].items()}}
    except (KeyError, TypeError, ValueError, AttributeError):  # not measured yet, or damaged
        pass
    costs = measure_costs(model, drafter, batch_size, cache_len, progress=progress)
    write_json(path, {**table, key: costs})
    return costs


MAX_REMEMBERED_ROUNDS = 20_000  # older decoding is forgotten beyond this many rounds per slot, so the estimate follows use


def _drafter_key(model: LoadedTarget, drafter: LoadedDrafter, sampled: bool) -> str:
    first = jax.tree.leaves(drafter.params)[0]
    parts = [repr(model.cfg), repr(drafter.cfg), drafter.meta.get("eval"), sampled,
             hashlib.sha256(jax.device_get(first).tobytes()).hexdigest()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def remember_acceptance(model: LoadedTarget, drafter: LoadedDrafter, rates: list[float], rounds: int,
                        sampled: bool) -> None:
    """Fold the per-slot acceptance measured while decoding (`rates` over `rounds` rounds; a prefix of the slots when
    fewer were drafted) into the running estimate kept in SPECFORMER_CACHE/decode_acceptance.json."""
    if rounds < 1:
        return
    path = cache_dir() / "decode_acceptance.json"
    table = _read_table(path)
    key = _drafter_key(model, drafter, sampled)
    old_rates, old_rounds = _acceptance_entry(table, key)
    pad = max(0, len(rates) - len(old_rates))
    new_rates, new_rounds = old_rates + [0.0] * pad, old_rounds + [0] * pad
    for i, r in enumerate(rates):
        n_old = min(new_rounds[i], MAX_REMEMBERED_ROUNDS)
        new_rates[i] = (new_rates[i] * n_old + r * rounds) / (n_old + rounds)
        new_rounds[i] = n_old + rounds
    write_json(path, {**table, key: {"rates": new_rates, "rounds": new_rounds}})


def _acceptance_entry(table: dict, key: str) -> tuple[list[float], list[float]]:
    """(rates, rounds) per slot recorded under `key`; none when the entry is missing or damaged (edited by hand)."""
    entry = table.get(key)
    try:
        rates, rounds = [float(r) for r in entry["rates"]], [float(n) for n in entry["rounds"]]
    except (TypeError, KeyError, ValueError):
        return [], []
    ok = len(rates) == len(rounds) and all(0 <= r <= 1 for r in rates) and all(n >= 0 for n in rounds)
    return (rates, rounds) if ok else ([], [])


def decoding_acceptance(model: LoadedTarget, drafter: LoadedDrafter, sampled: bool) -> list[float]:
    """Per-slot acceptance measured while decoding with this drafter (greedy or sampled), for the slots drafted so far."""
    table = _read_table(cache_dir() / "decode_acceptance.json")
    return _acceptance_entry(table, _drafter_key(model, drafter, sampled))[0]


def remember_batch_rounds(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, draft_len: int,
                          plain_steps: int, rounds: int, sampled: bool) -> None:
    """Add a speculative run's loop iterations (`rounds`, with `draft_len` drafts at `batch_size` rows) and the steps
    plain decoding needs for the same rows' tokens (`plain_steps`) to the totals kept in
    SPECFORMER_CACHE/batch_rounds.json, whose ratio auto uses as the tokens per round at that batch size."""
    if rounds < 1:
        return
    path = cache_dir() / "batch_rounds.json"
    table = _read_table(path)
    key = _drafter_key(model, drafter, sampled)
    entries = _batch_entries(table, key)
    old = entries.get((batch_size, draft_len), {"steps": 0.0, "rounds": 0.0})
    keep = min(1.0, MAX_REMEMBERED_ROUNDS / max(old["rounds"], 1))  # older runs fade out beyond the window
    entries[batch_size, draft_len] = {"steps": old["steps"] * keep + plain_steps,
                                      "rounds": old["rounds"] * keep + rounds}
    write_json(path, {**table, key: {f"{b},{k}": e for (b, k), e in entries.items()}})


def _batch_entries(table: dict, key: str) -> dict[tuple[int, int], dict]:
    """(batch size, k) -> {"steps", "rounds"} recorded under `key`; entries damaged by hand are left out."""
    entries = table.get(key)
    out = {}
    for name, e in entries.items() if isinstance(entries, dict) else ():
        try:
            b, k = map(int, name.split(","))
            if e["rounds"] > 0 and e["steps"] >= 0:
                out[b, k] = {"steps": float(e["steps"]), "rounds": float(e["rounds"])}
        except (ValueError, TypeError, KeyError):
            continue
    return out


def batch_rounds(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, sampled: bool) -> dict[int, dict]:
    """k -> {"steps", "rounds"} remembered for batches of `batch_size` rows with this drafter."""
    entries = _batch_entries(_read_table(cache_dir() / "batch_rounds.json"), _drafter_key(model, drafter, sampled))
    return {k: e for (b, k), e in entries.items() if b == batch_size}


def tokens_per_round(expected: dict[int, float], batches: dict[int, dict]) -> dict[int, float]:
    """The tokens per round auto predicts with, for each k of `expected` (E(k)): a batch's measured plain steps per
    round where batches of this size decoded with k drafts, else E(k) scaled by what the measured batches achieved
    against their E (a static batch waits for its slowest row whatever k is), but never scaled up: a few batches
    that beat E say little about another k."""
    seen = {k: b for k, b in batches.items() if k in expected}
    if not seen:
        return dict(expected)
    achieved = sum(b["steps"] for b in seen.values()) / sum(expected[k] * b["rounds"] for k, b in seen.items())
    efficiency = min(achieved, 1.0)
    return {k: seen[k]["steps"] / seen[k]["rounds"] if k in seen else e * efficiency for k, e in expected.items()}


@dataclasses.dataclass
class DraftLenChoice:
    draft_len: int
    predicted_speedup: dict[int, float]  # k -> predicted speedup over plain decoding
    step_seconds: float
    round_seconds: dict[int, float]
    acceptance: list[float]  # per slot, as used for the prediction
    acceptance_source: str  # "decoding" (measured while decoding), "teacher_forced" (eval), or "mixed"
    tokens_per_round: dict[int, float]  # k -> as used for the prediction
    batch_measured: list[int]  # the k measured on batches of this size (the others: E(k), scaled as they fell short)

    def to_json(self) -> dict:
        rounded = lambda d, n: {str(k): round(v, n) for k, v in d.items()}
        return {"draft_len": self.draft_len, "predicted_speedup": rounded(self.predicted_speedup, 3),
                "step_seconds": self.step_seconds, "round_seconds": {str(k): v for k, v in self.round_seconds.items()},
                "acceptance": [round(a, 4) for a in self.acceptance], "acceptance_source": self.acceptance_source,
                "tokens_per_round": rounded(self.tokens_per_round, 4), "batch_measured": self.batch_measured}


def auto_draft_len(model: LoadedTarget, drafter: LoadedDrafter, batch_size: int, cache_len: int,
                   sampled: bool = False, progress: bool = False) -> DraftLenChoice:
    measured = decoding_acceptance(model, drafter, sampled)
    taught = drafter_acceptance(drafter)
    acceptance = measured + taught[len(measured):]
    source = "teacher_forced" if not measured else "decoding" if len(measured) == len(taught) else "mixed"
    costs = measured_costs(model, drafter, batch_size, cache_len, progress)
    batches = batch_rounds(model, drafter, batch_size, sampled)
    tokens = tokens_per_round(expected_tokens(acceptance, costs["round_seconds"]), batches)
    speedups = predicted_speedups(costs["step_seconds"], costs["round_seconds"], tokens)
    return DraftLenChoice(choose_draft_len(speedups), speedups, costs["step_seconds"], costs["round_seconds"],
                          acceptance, source, tokens, sorted(k for k in batches if k in tokens))
