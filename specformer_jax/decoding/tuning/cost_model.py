"""The cost model behind `--draft-len auto` (pure: tuner.py feeds it measurements and records).

One speculative round with k drafts runs one target forward over k + 1 tokens per row plus the drafter, and emits
E(k) = 1 + c_1 + ... + c_k tokens per row on average, where c_i is the fraction of rounds in which slot i is accepted
(a drafter with fewer slots drafts a prefix of the same slots, so c_i does not depend on k). A plain decoding step
emits 1 token. With t_round(B, k) and t_step(B) measured on the current device at the batch size and cache length
at hand,

    predicted speedup(k) = tokens per round(k) * t_step(B) / t_round(B, k)

and the choice is the k with the largest prediction, or 0 (plain decoding) unless that beats plain decoding by
`margin`. At small batch a round reads the weights once for all k + 1 tokens and costs little more than a step, so
drafting pays; at large batch the forward becomes compute bound, t_round grows like k + 1, and the choice falls back
to plain decoding.

A static batch runs until its slowest row is done, so it needs more rounds than E(k) says. Where batches of this
size were recorded decoding with k drafts, their plain steps per round replace E(k); the other k's E(k) are scaled
down (never up) by the share of E the recorded batches achieved. A choice that did not pay at a batch size is so
not made again there; the margin covers the first call and timing noise.
"""

from __future__ import annotations

import dataclasses

from specformer_jax.defaults import AUTO_MARGIN


def expected_tokens(acceptance: list[float], ks) -> dict[int, float]:
    """E(k) = 1 + c_1 + ... + c_k: tokens a row emits per round with k drafts."""
    return {k: 1.0 + sum(acceptance[:k]) for k in ks}


def tokens_per_round(expected: dict[int, float], batches: dict[int, dict]) -> dict[int, float]:
    """The tokens per round to predict with, for each k of `expected` (E(k)): the recorded plain steps per round of
    batches of this size that decoded with k drafts, else E(k) scaled by what the recorded batches achieved against
    their E, but never scaled up: a few batches that beat E say little about another k."""
    seen = {k: b for k, b in batches.items() if k in expected}
    if not seen:
        return dict(expected)
    achieved = sum(b["steps"] for b in seen.values()) / sum(expected[k] * b["rounds"] for k, b in seen.items())
    efficiency = min(achieved, 1.0)
    return {k: seen[k]["steps"] / seen[k]["rounds"] if k in seen else e * efficiency for k, e in expected.items()}


def predicted_speedups(step_seconds: float, round_seconds: dict[int, float],
                       tokens: dict[int, float]) -> dict[int, float]:
    """speedup(k) = tokens per round(k) * t_step / t_round(k) for every measured k >= 1."""
    return {k: tokens[k] * step_seconds / t for k, t in sorted(round_seconds.items())}


def choose_draft_len(speedups: dict[int, float], margin: float = AUTO_MARGIN) -> int:
    """The k with the largest predicted speedup, or 0 (plain decoding) unless it is at least 1 + margin."""
    best = max(speedups, key=speedups.get, default=0)
    return best if best and speedups[best] >= 1.0 + margin else 0


def combined_acceptance(decoding: list[float], teacher_forced: list[float]) -> tuple[list[float], str]:
    """Per-slot acceptance to predict with: what decoding measured, teacher-forced figures for the slots never drafted
    yet; and where it came from: "decoding", "teacher_forced" or "mixed"."""
    source = "teacher_forced" if not decoding else "decoding" if len(decoding) == len(teacher_forced) else "mixed"
    return decoding + teacher_forced[len(decoding):], source


@dataclasses.dataclass
class DraftLenChoice:
    """A draft length chosen by the cost model, with everything the choice was made from."""

    draft_len: int
    predicted_speedup: dict[int, float]  # k -> predicted speedup over plain decoding
    step_seconds: float
    round_seconds: dict[int, float]
    acceptance: list[float]  # per slot, as used for the prediction
    acceptance_source: str  # "decoding" (measured while decoding), "teacher_forced" (eval), or "mixed"
    tokens_per_round: dict[int, float]  # k -> as used for the prediction
    batch_measured: list[int]  # the k recorded on batches of this size (the others: E(k), scaled as they fell short)
    margin: float = AUTO_MARGIN

    @property
    def reason(self) -> str:
        """The choice in words: the k and its prediction, or why plain decoding."""
        best = max(self.predicted_speedup, key=self.predicted_speedup.get, default=0)
        if self.draft_len:
            return f"k = {self.draft_len}: predicted {self.predicted_speedup[self.draft_len]:.2f}x plain decoding"
        if not best:
            return "plain decoding: no draft length was measured"
        return (f"plain decoding: no draft length is predicted to beat it by {self.margin:.0%} (the best, k = {best}, "
                f"{self.predicted_speedup[best]:.2f}x)")

    def to_json(self) -> dict:
        rounded = lambda d, n: {str(k): round(v, n) for k, v in d.items()}
        return {"draft_len": self.draft_len, "reason": self.reason,
                "predicted_speedup": rounded(self.predicted_speedup, 3),
                "step_seconds": self.step_seconds, "round_seconds": {str(k): v for k, v in self.round_seconds.items()},
                "acceptance": [round(a, 4) for a in self.acceptance], "acceptance_source": self.acceptance_source,
                "tokens_per_round": rounded(self.tokens_per_round, 4), "batch_measured": self.batch_measured}


def predict(costs: dict, acceptance: list[float], source: str, batches: dict[int, dict],
            margin: float = AUTO_MARGIN) -> DraftLenChoice:
    """The choice from measured costs ({"step_seconds", "round_seconds": {k: s}}), per-slot acceptance (and its
    source) and the batches recorded at this batch size ({k: {"steps", "rounds"}})."""
    tokens = tokens_per_round(expected_tokens(acceptance, costs["round_seconds"]), batches)
    speedups = predicted_speedups(costs["step_seconds"], costs["round_seconds"], tokens)
    return DraftLenChoice(choose_draft_len(speedups, margin), speedups, costs["step_seconds"], costs["round_seconds"],
                          acceptance, source, tokens, sorted(k for k in batches if k in tokens), margin)
