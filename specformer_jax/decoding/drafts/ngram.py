"""N-gram drafts (prompt lookup): a row drafts the tokens that followed the latest earlier occurrence of its last n
tokens in its own prompt and answer so far. No weights and no training, so any target can draft this way, and an
answer that copies its input (an edit, a fix, a reformatting) is drafted well.

Each row's tokens stay on the device in a `TokenHistory` that grows with the target cache; the lookup has fixed
shapes (a compare over the history for each of the n tried), so it runs inside the chunk with no host round trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.checks import integer
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.defaults import NGRAM_ACCEPTANCE

MAX_NGRAM_DRAFTS = 16  # the most drafts per round an n-gram source may be asked for


@struct.dataclass
class TokenHistory:
    """Each row's tokens, on the device: tokens[b, p] is the token at position p + 1 of row b (the token after
    position p), for the `lengths[b]` positions the target cache holds. The last of them is the row's last emitted
    token, which the target has not read yet; position 0 (the prompt's first token) is not kept."""

    tokens: jax.Array  # int32[B, S]
    lengths: jax.Array  # int32[B]

    @classmethod
    def zeros(cls, rows: int, max_len: int) -> "TokenHistory":
        return cls(jnp.zeros((rows, max_len), jnp.int32), jnp.zeros((rows,), jnp.int32))

    def grow(self, num_new: jax.Array, next_tokens: jax.Array) -> "TokenHistory":
        """With num_new[b] more positions, whose next tokens are next_tokens[b, :num_new[b]] (exact that far)."""
        T = next_tokens.shape[1]
        j = jnp.arange(T)[None, :]
        at = jnp.where(j < num_new[:, None], self.lengths[:, None] + j, self.tokens.shape[1])  # past the end: dropped
        rows = jnp.arange(self.tokens.shape[0])[:, None]
        return TokenHistory(self.tokens.at[rows, at].set(next_tokens, mode="drop"), self.lengths + num_new)

    def write_rows(self, new: "TokenHistory", slots: jax.Array, lens: jax.Array, Tp: int) -> "TokenHistory":
        """The first Tp positions of a b-row history written into rows `slots`, their lengths set to `lens`."""
        return TokenHistory(self.tokens.at[slots, :Tp].set(new.tokens[:, :Tp], mode="drop"),
                            self.lengths.at[slots].set(lens, mode="drop"))


def lookup(history: TokenHistory, k: int, max_n: int, min_n: int) -> tuple[jax.Array, jax.Array]:
    """(drafts int32[B, k], match length int32[B]): per row, the longest n in min_n..max_n whose last n tokens occur
    earlier in the row's history, and the k tokens that followed their latest such occurrence. A continuation that
    runs into the row's end repeats: the match says the text since it recurs, so it is assumed to recur again. A row
    with no match (match length 0) drafts its last token k times (an empty row: token 0)."""
    h, L = history.tokens, history.lengths
    B, S = h.shape
    pos = jnp.arange(S)[None, :]
    shifted = jnp.pad(h, ((0, 0), (max_n, 0)), constant_values=-1)
    run = jnp.ones((B, S), jnp.int32)  # tokens i - j .. i equal the row's last j + 1 tokens, for every j so far
    length = jnp.zeros((B, S), jnp.int32)
    for j in range(max_n):
        suffix = jnp.take_along_axis(h, jnp.maximum(L - 1 - j, 0)[:, None], axis=1)  # [B, 1]
        same = (shifted[:, max_n - j: max_n - j + S] == suffix) & (L - 1 - j >= 0)[:, None]
        run = run * same
        length = length + run
    length = jnp.where(pos < L[:, None] - 1, length, 0)  # an earlier occurrence ends before the row's last token
    n = jnp.max(length, axis=1)
    n = jnp.where(n >= min_n, n, 0)
    end = jnp.max(jnp.where((length >= n[:, None]) & (n[:, None] > 0), pos, -1), axis=1)  # the latest occurrence
    period = jnp.maximum(L - 1 - end, 1)
    at = end[:, None] + 1 + jnp.arange(k)[None, :] % period[:, None]
    at = jnp.where(n[:, None] > 0, at, jnp.maximum(L - 1, 0)[:, None])
    drafts = jnp.take_along_axis(h, jnp.clip(at, 0, S - 1), axis=1)
    return jnp.where(L[:, None] > 0, drafts, 0), n


def match_acceptance(match: jax.Array, k: int) -> jax.Array:
    """float32[B, k]: the chance that each of a row's k looked-up drafts is accepted given the drafts before it, by
    the length of the row's match (int32[B]; 0: no match, so none), as measured in `NGRAM_ACCEPTANCE` (a match longer
    than the table reads its last row, a slot past it the row's last value)."""
    rows = [[0.0] * k] + [(list(r) + [r[-1]] * k)[:k] for r in NGRAM_ACCEPTANCE]
    return jnp.asarray(rows, jnp.float32)[jnp.clip(match, 0, len(rows) - 1)]


def expected_accepted(acceptance: jax.Array, width: int) -> jax.Array:
    """float32[B]: drafts a row is expected to have accepted among its first `width`, from each draft's chance given
    the drafts before it ([B, k]): the sum of the chances that the chain holds that far."""
    return jnp.sum(jnp.cumprod(acceptance[:, :width], axis=1), axis=1)


def point_mass(plan: DecodePlan, drafts: jax.Array) -> jax.Array:
    """q of drafts chosen deterministically: one at the draft (float32[B, k, V]), or the greedy placeholder."""
    if plan.sampling.greedy:
        return jnp.zeros(drafts.shape + (1,), jnp.float32)
    return jax.nn.one_hot(drafts, plan.cfg.vocab_size, dtype=jnp.float32)


@struct.dataclass
class NgramState:
    history: TokenHistory
    match: jax.Array  # int32[B]: the length of the row's match (0: none, and its next round verifies no draft)

    def write_rows(self, new: "NgramState", slots, lens, Tp: int) -> "NgramState":
        return NgramState(self.history.write_rows(new.history, slots, lens, Tp),
                          self.match.at[slots].set(new.match, mode="drop"))


@struct.dataclass
class NgramDrafts:
    """A draft source (draft_source.py) drafting by n-gram lookup in each row's own tokens: `--drafter ngram`.
    max_n, min_n: the longest and shortest suffix tried (the longest that matches wins). A row with no match has
    nothing worth verifying: on a CPU, rounds in which no live row has a match are plain steps (chunk.run_chunk)."""

    max_n: int = struct.field(pytree_node=False, default=4)
    min_n: int = struct.field(pytree_node=False, default=1)

    origins = ("ngram", "no_match")

    def __post_init__(self):
        integer(1, 64, "an integer in 1..64").check("max_n", self.max_n)
        integer(1, self.max_n, f"an integer in 1..max_n = 1..{self.max_n}").check("min_n", self.min_n)

    def hooks(self, plan: DecodePlan) -> tuple[int, ...]:
        return ()

    def widths(self, plan: DecodePlan) -> tuple[int, ...]:
        return plan.draft_len, 0

    def empty_state(self, plan: DecodePlan, rows: int, max_len: int) -> NgramState:
        return NgramState(TokenHistory.zeros(rows, max_len), jnp.zeros((rows,), jnp.int32))

    def bind(self, plan: DecodePlan, target_params) -> "NgramDrafts":
        return self

    def draft(self, plan: DecodePlan, hidden, state: NgramState, num_new, slots_at, next_tokens, keys):
        history = state.history.grow(num_new, next_tokens)
        drafts, n = lookup(history, plan.draft_len, self.max_n, self.min_n)
        return drafts, point_mass(plan, drafts), NgramState(history, n)

    def origin(self, state: NgramState) -> jax.Array:
        return (state.match == 0).astype(jnp.int32)  # 0 "ngram", 1 "no_match"

    def confidence(self, plan: DecodePlan, drafts, q, state: NgramState):
        """Each copied draft's measured acceptance by the row's match length (`match_acceptance`); none without one."""
        return match_acceptance(state.match, drafts.shape[1])

    def advance(self, plan: DecodePlan, state: NgramState, num_new, next_tokens) -> NgramState:
        return NgramState(state.history.grow(num_new, next_tokens), state.match)
