"""Pallas ragged attention kernels against the jnp reference on CPU: the Triton-style GPU kernel under Pallas'
generic interpreter, the Mosaic TPU kernel under the TPU interpreter; gradients through the dispatcher; lowering
for TPU (jax.export) and CUDA without hardware; end-to-end speculative decoding on the kernels. On a GPU machine the
compiled Triton kernel joins the same tests (`pytest tests/test_kernels.py -k compiled`), with a TF32 tolerance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import ragged_attention, ragged_attention_reference
from pallas_kernels.cpu import build_cpu_kernels, cached_attention
from pallas_kernels.gpu import auto_num_splits, num_splits_for, ragged_attention_gpu, ragged_attention_gpu_fwd
from pallas_kernels.tpu import ragged_attention_tpu
from specformer_jax.files import cache_dir

KERNELS = {
    "gpu": lambda *a, **kw: ragged_attention_gpu(*a, interpret=True, **kw),
    "tpu": lambda *a, **kw: ragged_attention_tpu(*a, interpret=pltpu.InterpretParams(uninitialized_memory="nan"), **kw),
    # the CPU kernel (float32), on a stacked cache of two layers, the second one attended to
    "cpu": lambda q, k, v, lens, **kw: cached_attention(q, jnp.stack([k * 0, k]), jnp.stack([v * 0, v]), lens, 1,
                                                        **kw),
}
ON_GPU = jax.default_backend() == "gpu"
if ON_GPU:
    KERNELS["gpu_compiled"] = ragged_attention_gpu
# on a CPU the CPU kernel too, whose backward is the reference's
GRAD_IMPLS = ["interpret", "interpret_tpu"] + (["pallas_compiled"] if ON_GPU else ["cpu"])
# Compiled on a GPU, float32 dots run in TF32 (the kernel's and XLA's alike): about 1e-3 relative error.
TOLERANCE = {"gpu_compiled": dict(atol=3e-3, rtol=3e-3), "pallas_compiled": dict(atol=1e-2, rtol=5e-3)}

# (B, Q, H, Hkv, S, D, causal, sliding_window, lengths): GQA ratios 1/3/8, head dims 64/128, Q = 1 (decode),
# 5 and 9 (verify), 40 (chunked prefill); lengths from "only the new tokens" up to the full cache, ragged.
CASES = [
    (3, 5, 8, 8, 100, 64, True, None, [5, 64, 100]),
    (2, 1, 6, 2, 130, 64, True, None, [1, 129]),
    (3, 9, 24, 3, 150, 128, True, None, [9, 10, 150]),
    (2, 9, 8, 1, 70, 64, False, None, [9, 70]),
    (2, 5, 16, 2, 200, 128, False, None, [128, 129]),
    (2, 40, 8, 8, 96, 64, True, None, [40, 96]),
    (3, 5, 8, 1, 300, 64, True, 32, [5, 140, 300]),
]


def inputs(B, Q, H, Hkv, S, D, lengths, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Q, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, S, D)), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    stale = jnp.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    return q, jnp.where(stale, jnp.nan, k), jnp.where(stale, jnp.nan, v), lengths  # NaN past every valid length


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}Q{}H{}kv{}S{}D{}{}{}".format(
    *c[:6], "causal" if c[6] else "full", f"w{c[7]}" if c[7] else ""))
def test_kernel_matches_reference(kernel, case):
    B, Q, H, Hkv, S, D, causal, window, lengths = case
    q, k, v, lens = inputs(B, Q, H, Hkv, S, D, lengths)
    got = KERNELS[kernel](q, k, v, lens, causal=causal, sliding_window=window)
    want = ragged_attention_reference(q, k, v, lens, causal=causal, sliding_window=window)
    assert not jnp.isnan(got).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOLERANCE.get(kernel, dict(atol=2e-6, rtol=1e-5)))


@pytest.mark.parametrize("impl", ["cpu", "reference", "interpret", "interpret_tpu"])
def test_a_cache_with_more_rows_than_queries_is_read_by_its_first_rows(impl):
    """The server decodes a pool's first rows against the whole pool's cache (engine/pool.first_rows): row b of q
    attends to row b of the cache, whatever the rows after it hold (NaN here)."""
    B, Q, H, Hkv, S, D = 2, 4, 8, 2, 64, 64
    q, k, v, lens = inputs(B, Q, H, Hkv, S, D, [4, 40])
    pad = lambda x: jnp.concatenate([x, jnp.full((3,) + x.shape[1:], jnp.nan, x.dtype)])  # 3 more rows
    stacked = lambda x: jnp.stack([pad(x) * 0, pad(x)])  # [L=2, B + 3, ...]
    got = ragged_attention(q, stacked(k), stacked(v), lens, impl=impl, layer=1)
    want = ragged_attention_reference(q, k, v, lens)
    assert not jnp.isnan(got).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_the_flat_layout_on_the_cpu_kernel_matches_the_reference(window):
    """A verify pass's flat layout (Q = 1, query row t reads cache row rows[t]): runs of one cache row, rows read
    twice apart, a run whose lengths step by one (a request's chain), a query that sees nothing (padding: zeros),
    GQA, and NaN past every length the cache rows are read to."""
    H, Hkv, S, D = 6, 2, 48, 64
    rows = jnp.asarray([2, 2, 2, 0, 1, 1, 3, 0, 0], jnp.int32)
    lens = jnp.asarray([20, 21, 22, 5, 40, 41, 0, 9, 10], jnp.int32)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((9, 1, H, D)), jnp.float32)
    seen = jnp.zeros((4,), jnp.int32).at[rows].max(lens)
    stale = jnp.arange(S)[None, None, :, None] >= seen[:, None, None, None]
    k, v = (jnp.where(stale, jnp.nan, jnp.asarray(rng.standard_normal((4, Hkv, S, D)), jnp.float32)) for _ in "kv")
    want = ragged_attention_reference(q, k[rows], v[rows], lens, sliding_window=window)
    got = ragged_attention(q, jnp.stack([k * 0, k]), jnp.stack([v * 0, v]), lens, impl="cpu", layer=1, rows=rows,
                           sliding_window=window)
    assert not jnp.isnan(got).any() and not got[6].any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    ref = ragged_attention(q, k, v, lens, impl="reference", rows=rows, sliding_window=window)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(want), atol=2e-6, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """The CPU kernels, built as decoding builds them (a machine with a C++ compiler: CI has one)."""
    assert build_cpu_kernels(cache_dir() / "kernels") is None


@pytest.mark.parametrize("kernel", sorted(set(KERNELS) - {"cpu"}))  # the CPU kernel takes float32 only
def test_kernel_bfloat16(kernel):
    q, k, v, lens = inputs(2, 5, 8, 2, 160, 128, [5, 160], dtype=jnp.bfloat16)
    got = KERNELS[kernel](q, k, v, lens).astype(jnp.float32)
    want = ragged_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), lens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2)


# Split-KV (flash-decoding) forward: (B, Q, H, Hkv, S, D, causal, window, lengths). Rows of length 0 and 1 and rows
# shorter than one split (most splits see nothing), GQA 1/8/3/4, head dims 64/128, both masks, a sliding window; the
# automatic choice is 2 for most of these and 3 for the 384-entry cache (6 tiles: an uneven split).
SLOW = pytest.mark.slow  # kept out of `make test` to fit CI's time; `make test-all` runs them
SPLIT_CASES = [
    (4, 1, 8, 8, 256, 64, True, None, [0, 1, 70, 256]),
    pytest.param((3, 5, 24, 3, 300, 128, True, None, [5, 6, 300]), marks=SLOW),
    pytest.param((2, 9, 9, 3, 384, 64, False, None, [9, 257]), marks=SLOW),
    (2, 5, 8, 2, 256, 64, True, 40, [5, 256]),
]
SPLIT_KERNELS = ["gpu"] + (["gpu_compiled"] if ON_GPU else [])


@pytest.mark.parametrize("kernel", SPLIT_KERNELS)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "B{}Q{}H{}kv{}S{}D{}{}{}".format(
    *c[:6], "causal" if c[6] else "full", f"w{c[7]}" if c[7] else ""))
def test_split_kv_matches_reference_and_keeps_the_residuals(kernel, case):
    """Every split count gives the reference's output and the one-pass kernel's residuals (o, lse), which the
    backward reads."""
    B, Q, H, Hkv, S, D, causal, window, lengths = case
    q, k, v, lens = inputs(B, Q, H, Hkv, S, D, lengths)
    fwd = lambda n: ragged_attention_gpu_fwd(q, k, v, lens, causal=causal, sliding_window=window, num_splits=n,
                                             interpret=kernel == "gpu")
    want = ragged_attention_reference(q, k, v, lens, causal=causal, sliding_window=window)
    tol = TOLERANCE.get(kernel, dict(atol=2e-6, rtol=1e-5))
    _, (*_, o1, lse1) = fwd(1)
    for n in dict.fromkeys((1, 2, 4, num_splits_for(q, k))):  # the automatic count, resolved: one compile fewer
        got, (*_, o, lse) = fwd(n)
        assert not jnp.isnan(got).any(), n
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), err_msg=f"num_splits={n}", **tol)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o1), err_msg=f"o, num_splits={n}", **tol)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), err_msg=f"lse, num_splits={n}", **tol)
    assert not np.asarray(lse1)[np.asarray(lens) == 0].any()  # nothing visible: lse 0, as the backward expects


def test_auto_num_splits():
    # Llama-3-8B heads (8 KV heads), one query block, 64-position tiles: batch 64 already fills an H100 (512
    # programs); batch 1 and 8 split to about 256 programs; SmolLM2 (3 KV heads) at 1k: capped at 2 tiles a split.
    assert auto_num_splits(64, 8, 1, 128) == 1
    assert auto_num_splits(1, 8, 1, 128) == 32
    assert auto_num_splits(8, 8, 1, 64) == 4
    assert auto_num_splits(1, 3, 1, 16) == 8
    assert auto_num_splits(1, 8, 1, 1) == 1  # a single tile is never split
    assert auto_num_splits(2, 8, 32, 8) == 1  # a prefill chunk has query blocks enough
    for batch in (1, 2, 5, 64):
        for tiles in (1, 2, 3, 7, 64, 1000):
            n = auto_num_splits(batch, 3, 1, tiles)
            assert 1 <= n <= max(1, tiles // 2) and (n == 1 or batch * 3 * (n - 1) < 256)
    # From shapes: the cache is padded to whole tiles (1000 -> 16) and Q = 9 x 4 heads fill one 64-row block.
    struct = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    assert num_splits_for(struct(1, 9, 32, 128), struct(1, 8, 1000, 128)) == 8
    assert num_splits_for(struct(1, 5, 32, 128), struct(1, 8, 8192, 128)) == 32
    assert num_splits_for(struct(64, 5, 32, 128), struct(64, 8, 8192, 128)) == 1


GRAD_CASES = [  # (B, Q, H, Hkv, S, D, causal, window, lengths)
    (2, 6, 4, 2, 40, 64, True, None, [6, 33]),  # verify-like, ragged
    (2, 24, 6, 2, 24, 64, True, None, [24, 24]),  # training: the whole sequence is new (the drafter's context layer)
    (2, 24, 8, 8, 70, 64, True, 8, [30, 70]),  # chunked prefill with a sliding window
    (2, 5, 8, 1, 50, 128, False, None, [5, 50]),  # bidirectional inside the appended block
]


def check_gradient(case, impl, num_splits=None):
    B, Q, H, Hkv, S, D, causal, window, lengths = case
    q, k, v, lens = inputs(B, Q, H, Hkv, S, D, lengths, seed=1)
    finite = lambda x: jnp.nan_to_num(x)  # the reference's own gradient is NaN-unsafe: give it a clean cache
    w = jax.random.normal(jax.random.key(0), q.shape)

    def loss(impl, k, v):
        return lambda q: jnp.sum(w * ragged_attention(q, k, v, lens, causal=causal, sliding_window=window, impl=impl,
                                                      num_splits=num_splits))

    # NaN past the lengths
    got = jax.grad(lambda q, k, v: loss(impl.removesuffix("_compiled"), k, v)(q), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: loss("reference", k, v)(q), argnums=(0, 1, 2))(q, finite(k), finite(v))
    for name, g, r in zip("qkv", got, want):
        assert not jnp.isnan(g).any(), name
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), err_msg=name,
                                   **TOLERANCE.get(impl, dict(atol=2e-5, rtol=1e-4)))


@pytest.mark.parametrize("impl,case", [
    # the TPU interpreter is slow: its first case runs with the fast tests, the others with the slow ones; the
    # interpreter's training case (the whole sequence new) too, as its ragged verify-like case takes the same path
    pytest.param(impl, case, marks=SLOW) if (impl == "interpret_tpu" and i) or (impl == "interpret" and i == 1)
    else (impl, case)
    for impl in GRAD_IMPLS for i, case in enumerate(GRAD_CASES)])
def test_fused_backward_matches_the_reference_gradient(case, impl):
    check_gradient(case, impl)


# Slow in interpret mode (~20 s); the split forward's residuals equal the unsplit ones (tested above), so the
# backward cannot tell. Compiled on a GPU it runs with the fast tests.
@pytest.mark.parametrize("impl", [pytest.param("interpret", marks=pytest.mark.slow)]
                         + (["pallas_compiled"] if ON_GPU else []))
@pytest.mark.parametrize("case,num_splits", [
    ((2, 6, 4, 2, 200, 64, True, None, [6, 180]), 4),  # verify-like, ragged: the short row leaves splits empty
    ((2, 5, 8, 1, 256, 128, False, 24, [0, 250]), 3),  # bidirectional, window, a row with nothing visible
])
def test_split_kv_forward_keeps_the_fused_backward_exact(case, num_splits, impl):
    check_gradient(case, impl, num_splits)


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernels need a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_backward_at_training_shapes(dtype):
    """The drafter's context layer on SmolLM2 while training: 9 query heads over 3 KV heads, head dim 64, whole
    512-token sequences. Large tiles here once overflowed the GPU's shared memory."""
    q, k, v, lens = inputs(4, 512, 9, 3, 512, 64, [512, 300, 512, 17], dtype=dtype, seed=2)
    w = jax.random.normal(jax.random.key(0), q.shape, jnp.float32)
    up = lambda *xs: [x.astype(jnp.float32) for x in xs]
    loss = lambda impl: lambda q, k, v: jnp.sum(w * ragged_attention(q, k, v, lens, impl=impl).astype(jnp.float32))
    got = jax.grad(loss("pallas"), argnums=(0, 1, 2))(q, k, v)
    with jax.default_matmul_precision("highest"):
        want = jax.grad(loss("reference"), argnums=(0, 1, 2))(*up(q, jnp.nan_to_num(k), jnp.nan_to_num(v)))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == jnp.float32 else dict(atol=0.3, rtol=0.1)
    for name, g, r in zip("qkv", got, want):
        assert not jnp.isnan(g).any(), name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), err_msg=name, **tol)


def test_cpu_kernel_gradients_reach_the_layer_attended_to():
    """Through a stacked cache (the decoding layout's [L, B, Hkv, S, D]): the attended layer's gradient is the
    reference's, the other layers' zero."""
    q, k, v, lens = inputs(2, 5, 8, 2, 40, 64, [5, 40], seed=3)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    ks, vs = jnp.stack([k * 2, k, k * 3]), jnp.stack([v * 2, v, v * 3])
    w = jax.random.normal(jax.random.key(1), q.shape)
    got = jax.grad(lambda q, ks, vs: jnp.sum(w * ragged_attention(q, ks, vs, lens, layer=1, impl="cpu")),
                   argnums=(0, 1, 2))(q, ks, vs)
    want = jax.grad(lambda q, k, v: jnp.sum(w * ragged_attention_reference(q, k, v, lens)), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=1e-4)
    for g, r in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g[1], r, atol=2e-5, rtol=1e-4)
        assert not g[0].any() and not g[2].any()


def test_bad_impls():
    q, k, v, lens = inputs(2, 6, 4, 2, 40, 64, [6, 33])
    with pytest.raises(ValueError, match="unknown attention impl"):
        ragged_attention(q, k, v, lens, impl="fast")
    with pytest.raises(ValueError, match="needs a TPU or a GPU"):
        ragged_attention(q, k, v, lens, impl="pallas")  # this machine is a CPU


def shapes(B, Q, H, Hkv, S, D, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((B, Q, H, D), dtype), jax.ShapeDtypeStruct((B, Hkv, S, D), dtype),
            jax.ShapeDtypeStruct((B, Hkv, S, D), dtype), jax.ShapeDtypeStruct((B,), jnp.int32))


@pytest.mark.parametrize("B,Q,H,Hkv,S,D,splits", [(64, 5, 32, 8, 1024, 128, 1), (8, 9, 9, 3, 1000, 64, 8),
                                                  (2, 256, 8, 8, 512, 128, 4)])
def test_kernels_lower_for_tpu_and_cuda(B, Q, H, Hkv, S, D, splits):
    exp = export.export(jax.jit(lambda *a: ragged_attention(*a, impl="pallas_tpu")), platforms=["tpu"])(
        *shapes(B, Q, H, Hkv, S, D))
    assert exp.mlir_module().count("tpu_custom_call") == 1
    grad = jax.grad(lambda q, k, v, l: jnp.sum(ragged_attention(q, k, v, l, impl="pallas_tpu").astype(jnp.float32)),
                    argnums=(0, 1, 2))
    exp = export.export(jax.jit(grad), platforms=["tpu"])(*shapes(B, Q, H, Hkv, S, D))
    assert exp.mlir_module().count("tpu_custom_call") == 3  # forward, dq, dk/dv
    lowered = jax.jit(lambda *a: ragged_attention(*a, impl="pallas_gpu")).trace(*shapes(B, Q, H, Hkv, S, D)).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("triton") == 1
    assert num_splits_for(*shapes(B, Q, H, Hkv, S, D)[:2]) == splits  # the GPU forward's own choice, lowered here
    assert ("ragged_attention_gpu_split" in lowered.as_text()) == (splits > 1)
    grad = jax.grad(lambda q, k, v, l: jnp.sum(ragged_attention(q, k, v, l, impl="pallas_gpu").astype(jnp.float32)),
                    argnums=(0, 1, 2))
    lowered = jax.jit(grad).trace(*shapes(B, Q, H, Hkv, S, D)).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("triton") == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("impl", ["interpret", pytest.param("interpret_tpu", marks=pytest.mark.slow)])
def test_speculative_decoding_on_the_kernels_gives_the_reference_tokens(tiny_checkpoints, impl):
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.config import DrafterConfig
    from specformer_jax.decoding.api import generate
    from specformer_jax.modeling.drafter import init_drafter
    from specformer_jax.modeling.loaded import LoadedDrafter

    prompts = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72]]
    ref = load_target(tiny_checkpoints["llama3"], attention_impl="reference")
    fast = load_target(tiny_checkpoints["llama3"], attention_impl=impl)
    cfg = DrafterConfig(num_slots=3)
    drafter = LoadedDrafter(cfg, init_drafter(ref.cfg, cfg, jax.random.key(0)), {})
    want = generate(ref, prompts, max_new_tokens=12, drafter=drafter, draft_len=3)
    got = generate(fast, prompts, max_new_tokens=12, drafter=drafter, draft_len=3)
    assert got.token_ids == want.token_ids
    assert got.stats["rounds"] == want.stats["rounds"]


def test_pallas_on_a_cpu_is_a_clear_error(tiny_checkpoints, cli_error):
    err = cli_error(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompt", "hi", "--attention-impl",
                     "pallas"])
    assert "needs a TPU or a GPU" in err


def test_bench_kernels_cli_smoke(tmp_path, cli_error):
    """The GPU benchmark command runs end to end (interpreted kernel, tiny shapes); timings here mean nothing."""
    import json

    from specformer_jax.cli import main

    out = tmp_path / "k.json"
    argv = ["bench-kernels", "--batch-sizes", "2", "--queries", "5", "--cache-lens", "130,256", "--heads", "4",
            "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--impl", "interpret", "--repeats", "2",
            "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("specformer bench-kernels") and doc["impl"] == "interpret" and doc["complete"]
    assert [(r["cache_len"], r["num_splits"]) for r in doc["results"]] == [(130, 1), (256, 2)]  # 4 tiles: 2 splits
    assert doc["results"][0]["bytes"] == (2 * 2 * 2 * 130 + 2 * 2 * 5 * 4) * 64 * 4
    assert "needs a TPU or a GPU" in cli_error(argv[:-6] + ["--impl", "pallas", "--out", str(out)])
    assert "--queries" in cli_error(argv[:4] + ["--queries", "0"] + argv[6:])


def test_chained_calls_compute_the_attention_and_depend_on_each_other():
    """bench-kernels --chain: the chain's output is the attention's (the nudge is below rounding), and each call's
    query depends on the previous output, so XLA cannot merge the calls into one."""
    from specformer_jax.bench.kernels import chained

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 5, 4, 64))
    k, v = (jax.random.normal(kk, (2, 2, 96, 64)) for kk in keys[1:])
    lens = jnp.array([96, 40], jnp.int32)
    one = ragged_attention_reference(q, k, v, lens)
    np.testing.assert_array_equal(jax.jit(chained("reference", 3))(q, [k], [v], lens), one)
    exps = lambda n: jax.jit(chained("reference", n)).lower(q, [k], [v], lens).compile().as_text().count("exponential")
    assert exps(3) == 3 * exps(1) > 0  # three softmaxes survive compilation (independent calls would be merged)
    # with two buffers the calls alternate: the last of three reads the first buffer, the last of two the second
    k2, v2 = k[::-1], v[::-1]
    two = ragged_attention_reference(q, k2, v2, lens)
    np.testing.assert_array_equal(jax.jit(chained("reference", 3))(q, [k, k2], [v, v2], lens), one)
    np.testing.assert_array_equal(jax.jit(chained("reference", 2))(q, [k, k2], [v, v2], lens), two)


def test_chains_cycle_through_enough_buffers_to_miss_the_cache():
    from specformer_jax.bench.kernels import COLD_BYTES, num_buffers

    assert num_buffers(1, 1000) == 1 and num_buffers(20, 10 * COLD_BYTES) == 1
    assert num_buffers(20, COLD_BYTES // 4) == 4 and num_buffers(20, COLD_BYTES // 4 - 1) == 5
    assert num_buffers(20, 1000) == 20
