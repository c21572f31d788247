"""The flat layout of a verify pass (Q = 1, query row t reads cache row rows[t]) on the Pallas kernels, which read
the cache rows in place (no gathered copy): against the reference on the explicitly gathered cache, and lowered for
TPU (jax.export) and CUDA without hardware."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import ragged_attention, ragged_attention_reference

# 8 query rows over a 5-row cache (row 4 never read): runs of one cache row whose lengths step by one (a request's
# chain), rows read again apart, a length past one TPU tile (128), and a query that sees nothing (padding).
ROWS = [2, 2, 2, 0, 1, 1, 3, 0]
LENGTHS = [20, 21, 22, 5, 140, 141, 0, 9]
H, HKV, S, D, CACHE_ROWS = 4, 2, 160, 64, 5


def flat_inputs(seed=0):
    """q [8, 1, H, D], k and v [CACHE_ROWS, HKV, S, D] with NaN past the longest length any query reads a row to."""
    rng = np.random.default_rng(seed)
    rows, lens = jnp.asarray(ROWS, jnp.int32), jnp.asarray(LENGTHS, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(ROWS), 1, H, D)), jnp.float32)
    seen = jnp.zeros((CACHE_ROWS,), jnp.int32).at[rows].max(lens)
    stale = jnp.arange(S)[None, None, :, None] >= seen[:, None, None, None]
    k, v = (jnp.where(stale, jnp.nan, jnp.asarray(rng.standard_normal((CACHE_ROWS, HKV, S, D)), jnp.float32))
            for _ in "kv")
    return q, k, v, lens, rows


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("impl,num_splits", [("reference", None), ("interpret", None), ("interpret", 2),
                                             ("interpret_tpu", None)])
def test_the_flat_layout_matches_the_reference_on_the_gathered_cache(impl, num_splits, window):
    q, k, v, lens, rows = flat_inputs()
    want = ragged_attention_reference(q, k[rows], v[rows], lens, causal=True, sliding_window=window)
    stacked = lambda x: jnp.stack([x * 0, x])  # a stacked cache of two layers, the second attended to
    got = ragged_attention(q, stacked(k), stacked(v), lens, causal=True, sliding_window=window, impl=impl,
                           num_splits=num_splits, layer=1, rows=rows)
    assert got.shape == q.shape and not jnp.isnan(got).any()
    assert not got[LENGTHS.index(0)].any()  # nothing visible: zeros
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


def flat_shapes(B, cache_rows, H, Hkv, S, D, dtype=jnp.bfloat16):
    cache = jax.ShapeDtypeStruct((cache_rows, Hkv, S, D), dtype)
    return (jax.ShapeDtypeStruct((B, 1, H, D), dtype), cache, cache, jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((B,), jnp.int32))


@pytest.mark.parametrize("B,cache_rows,H,Hkv,S,D", [(40, 8, 32, 8, 1024, 128), (12, 3, 9, 3, 1000, 64)])
def test_the_flat_layout_lowers_for_tpu_and_cuda_without_gathering_the_cache(B, cache_rows, H, Hkv, S, D):
    def attend(impl):
        return jax.jit(lambda q, k, v, lens, rows: ragged_attention(q, k, v, lens, impl=impl, rows=rows))

    mlir = export.export(attend("pallas_tpu"), platforms=["tpu"])(*flat_shapes(B, cache_rows, H, Hkv, S, D))
    mlir = mlir.mlir_module()
    assert mlir.count("tpu_custom_call") == 1 and "stablehlo.gather" not in mlir
    text = attend("pallas_gpu").trace(*flat_shapes(B, cache_rows, H, Hkv, S, D)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") == 1 and "stablehlo.gather" not in text
