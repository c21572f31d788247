"""Set acceptance, the acceptance rule of cost measurements (`generate(set_acceptance=rate)`, `bench
--set-acceptance`): each draft is accepted with a set probability instead of when the target agrees, so a drafter of
any acceptance can be timed on any model, random weights included. Every round still pays the target's verify
forward and the drafter; only which drafts count as accepted is drawn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.decoding.acceptance.sampling import SamplingConfig, select_tokens
from specformer_jax.decoding.acceptance.speculative import leading, verified_slots


@struct.dataclass
class SetAcceptance:
    """Draft i is accepted with probability `rate` when the ones before it were (from the row's accept key), and
    the token after the n accepted ones is the target's there, as in a real round (its argmax, or drawn from it
    when sampling). The caches then hold exactly the emitted tokens, so real rounds can follow. The rate is data,
    not part of the compiled round: a sweep over rates compiles once."""

    rate: jax.Array  # float32[]

    def __call__(self, logits, drafts, q, keys, sampling: SamplingConfig, limit=None):
        k = drafts.shape[1]
        u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys[:, 0])
        n = leading((u < self.rate) & verified_slots(k, limit))
        at_n = jnp.take_along_axis(logits, n[:, None, None], axis=1)[:, 0]  # [B, V]
        return n, select_tokens(at_n, keys[:, 1], sampling)


def law_accepted_length(rate: float, k: int) -> float:
    """Expected tokens a round emits when each draft is accepted with probability `rate` given the ones before it:
    1 + rate + ... + rate^k."""
    return sum(rate**i for i in range(k + 1))
