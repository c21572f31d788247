"""Plain autoregressive decoding of a ragged batch, entirely on the device in one `lax.while_loop`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specformer_jax.config import TargetConfig
from specformer_jax.decoding.sampling import SamplingConfig, select_tokens, step_keys
from specformer_jax.modeling.kv_cache import KVCache, target_cache
from specformer_jax.modeling.target import Target


@struct.dataclass
class ARState:
    step: jax.Array  # int32[]: loop iteration
    cache: KVCache
    last: jax.Array  # int32[B]: last emitted token, the next input
    out: jax.Array  # int32[B, N]: emitted tokens
    num_out: jax.Array  # int32[B]
    done: jax.Array  # bool[B]


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    return jnp.isin(tokens, jnp.asarray(eos_ids or (-1,), jnp.int32))


def ar_generate(
    params,
    prompts: jax.Array,  # int32[B, Tp], right-padded
    prompt_lens: jax.Array,  # int32[B]
    max_new: jax.Array,  # int32[B]: per-row budget (0 = inactive padding row)
    row_keys: jax.Array,  # PRNG key per row
    *,
    cfg: TargetConfig,
    sampling: SamplingConfig,
    eos_ids: tuple[int, ...],
    max_new_tokens: int,  # static N >= max(max_new): output buffer width and loop bound
):
    """Returns (tokens int32[B, N], num_out int32[B], steps int32[]). Tokens past num_out are 0. steps counts the
    decoding loop's iterations (the prefill, which emits the first token, not among them), as the speculative loop
    counts its rounds."""
    model = Target(cfg)
    B, Tp = prompts.shape
    N = max_new_tokens
    cache = target_cache(cfg, B, Tp + N)
    with jax.named_scope("prefill"):
        logits, cache, _ = model.apply({"params": params}, prompts, cache, prompt_lens, (prompt_lens - 1)[:, None])
    first = select_tokens(logits[:, 0], step_keys(row_keys, 0), sampling)
    active = max_new > 0
    state = ARState(
        step=jnp.int32(1),
        cache=cache,
        last=first,
        out=jnp.zeros((B, N), jnp.int32).at[:, 0].set(jnp.where(active, first, 0)),
        num_out=active.astype(jnp.int32),
        done=~active | is_eos(first, eos_ids) | (max_new <= 1),
    )

    def cond(s: ARState):
        return (s.step < N) & ~jnp.all(s.done)

    def body(s: ARState):
        with jax.named_scope("decode_step"):
            logits, cache, _ = model.apply({"params": params}, s.last[:, None], s.cache)
        tok = select_tokens(logits[:, 0], step_keys(row_keys, s.step), sampling)
        live = ~s.done
        out = s.out.at[jnp.arange(B), jnp.where(live, s.num_out, N)].set(tok, mode="drop")  # finished rows: dropped
        num_out = s.num_out + live
        done = s.done | is_eos(tok, eos_ids) | (num_out >= max_new)
        cache = cache.replace(lengths=jnp.where(live, cache.lengths, s.cache.lengths))
        return ARState(s.step + 1, cache, jnp.where(live, tok, s.last), out, num_out, done)

    final = jax.lax.while_loop(cond, body, state)
    return final.out, final.num_out, final.step - 1
