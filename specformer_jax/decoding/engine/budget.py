"""A round that verifies a budget of positions, not a rectangle: which drafts enter the target's verify pass.

Every live row gets its last token x (a plain step for that row at least); the rest of the budget goes to the most
valuable drafts across all rows, where the value of draft i of a row is the chance that it and every draft before it
are accepted: the product of the drafts' confidences (the draft source's, `confidence`: from the drafter's
distributions, never from the tokens drawn from them). Values fall along a row, so
the chosen drafts of a row are always its first m. The chosen positions are laid out flat, a row's on consecutive
entries ([x, d_1..d_m]), and the target runs over that list (`Target.forward_flat`): a draft not chosen costs
nothing. The budget is static (one compilation per size); entries left over are padding placed past the caches.

The budget can also be chosen each round among a few sizes (`budget_sizes`: positions and each one's measured cost
of a round): the size whose expected tokens (the live rows' plus the sum of the chosen drafts' values) per unit of
cost is largest, each size its own branch of a `lax.switch` (`best_size`), so a round costs what its size costs.

Verifying the first m of a row's drafts is the round with m drafts: the choice of m depends on the drafter's
distributions alone, not on the target nor on the draws, so greedy output stays plain greedy output and sampled
output keeps the target's distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specformer_jax.decoding.acceptance.sampling import greedy_tokens
from specformer_jax.decoding.acceptance.speculative import Verify, greedy_verdict

Sizes = tuple[tuple[int, float], ...]  # (positions, the cost of a round with them), positions ascending


def budget_sizes(budget: int | Sizes) -> Sizes:
    """A budget as sizes to choose from: a number of positions is the one size (0: no budget, none); sizes as they
    are, sorted by positions."""
    if isinstance(budget, tuple):
        return tuple(sorted((int(b), float(c)) for b, c in budget))
    return ((int(budget), 1.0),) if budget else ()


def best_size(values: jax.Array, live: jax.Array, sizes: Sizes) -> jax.Array:
    """int32[]: the index of the size in `sizes` whose round is expected to emit the most tokens per unit of cost:
    every live row's one token plus the values of the most valuable drafts that fit (values [P, k], `draft_values`)."""
    top = jnp.maximum(jnp.sort(values.reshape(-1))[::-1], 0.0)
    total = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(top)])
    n_live = jnp.sum(live)
    spare = jnp.clip(jnp.asarray([b for b, _ in sizes]) - n_live, 0, top.shape[0])
    return jnp.argmax((n_live + total[spare]) / jnp.asarray([c for _, c in sizes])).astype(jnp.int32)


def draft_values(confidence: jax.Array, live: jax.Array) -> jax.Array:
    """float32[P, k]: the chance that draft i of row b and the drafts before it are all accepted (confidence
    [P, k]: each draft's chance given the ones before it); -1 for rows not live."""
    values = jnp.cumprod(jnp.clip(confidence, 0.0, 1.0), axis=1)
    return jnp.where(live[:, None], values, -1.0)


def chosen_lengths(values: jax.Array, live: jax.Array, budget: int) -> jax.Array:
    """int32[P]: drafts each row verifies, the most valuable across rows first, so that the live rows' last tokens
    and their drafts fill at most `budget` positions (a draft of value 0 is never chosen)."""
    P, k = values.shape
    spare = budget - jnp.sum(live)
    top, at = jax.lax.top_k(values.reshape(-1), min(budget, P * k))
    take = (jnp.arange(top.shape[0]) < spare) & (top > 0)
    return jnp.zeros((P,), jnp.int32).at[at // k].add(take.astype(jnp.int32))


def flat_layout(live: jax.Array, lengths: jax.Array, k: int, budget: int):
    """The flat list of a round's positions. Returns (index int32[P, k + 1]: each row position's entry in the list,
    `budget` where it has none; rows, at int32[budget]: each entry's row and position in it ([x, d_1..d_k]); valid
    bool[budget]: entries that are not padding)."""
    P = live.shape[0]
    size = jnp.where(live, lengths + 1, 0)
    first = jnp.cumsum(size) - size
    j = jnp.arange(k + 1)[None, :]
    index = jnp.where(j < size[:, None], first[:, None] + j, budget)
    put = lambda values, fill: jnp.full((budget,), fill, values.dtype).at[index].set(values, mode="drop")
    rows = put(jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[:, None], index.shape), 0)
    at = put(jnp.broadcast_to(j, index.shape).astype(jnp.int32), 0)
    valid = put(jnp.ones_like(index, bool), False)
    return index, rows, at, valid


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """A flat list's entries [budget, ...] back in the padded layout [P, k + 1, ...] (`flat_layout`'s index);
    positions without an entry get the last entry, which masks keep from ever affecting a result (a row's drafts
    past its cut are not accepted; the drafter keeps only its accepted positions)."""
    return x[jnp.minimum(index, x.shape[0] - 1)]


def verify_flat(accept, logits: jax.Array, index: jax.Array, drafts, q, keys, sampling, chosen: jax.Array):
    """(n, final) of a flat pass's logits [budget, V], row b's drafts past its first chosen[b] not verified. Greedy
    verification picks the target's tokens on the flat list and gathers those alone; other rules (sampling, a
    measurement's) are given the logits in the padded layout."""
    if sampling.greedy and isinstance(accept, Verify):
        return greedy_verdict(gather_rows(greedy_tokens(logits), index), drafts, chosen)
    return accept(gather_rows(logits, index), drafts, q, keys, sampling, chosen)
