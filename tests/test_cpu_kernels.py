"""The CPU kernels (pallas_kernels/cpu.cc, built on first use) against numpy in float64 and the jnp references: the
packed and rows matrix products (any shape, leading dimensions, a row's product the same bit for bit however many
rows come with it, bfloat16 panels, gradients), built for each vector width this CPU runs, and what decoding does
where they cannot be built (a one-line note, XLA's matmuls, the same tokens), a drafter packed as the target is. The
attention kernel is held against the reference with the other kernels in test_kernels.py."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.api import generate
from specformer_jax.modeling.drafter import Drafter, drafter_cache, init_drafter, pack_drafter
from specformer_jax.modeling.loaded import cpu_kernels_ready

# (M, K, N). With AVX2, 6 and 12 rows end in a 3-row whole-panel tile; with AVX-512, 18 rows are a tile of 14 and
# one of 4 (tiles of 2-4 rows hold each weight in a register for all their rows).
SHAPES = [(1, 576, 960), (5, 576, 3072), (13, 150, 70), (3, 17, 5), (9, 33, 49), (40, 64, 40), (6, 40, 70),
          (7, 17, 33), (12, 33, 49), (4, 40, 70), (18, 33, 49)]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernels, built as decoding builds them (a machine with a C++ compiler: CI has one)."""
    assert cpu_kernels_ready(load_target("random:tiny", dtype="float32").cfg), "the CPU kernels did not build"


def random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matrix_products_match_numpy(M, K, N):
    x, w = random((M, K), 0), random((K, N), 1)
    packed = jax.jit(cpu.packed_matmul, static_argnums=2)(x, cpu.pack_columns(w), N)
    np.testing.assert_allclose(packed, np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5,
                               atol=1e-4 * np.sqrt(K))
    assert packed.shape == (M, N)


def test_leading_dimensions_and_the_references():
    x, w = random((2, 3, 40), 3), random((40, 70), 4)
    panels = cpu.pack_columns(w)
    assert panels.shape == (3, 40, cpu.PANEL)  # 70 columns: 3 panels, the last padded with zeros
    np.testing.assert_array_equal(cpu.unpack_columns(panels, 70), w)
    np.testing.assert_allclose(cpu.packed_matmul(x, panels, 70), cpu.packed_matmul_reference(x, panels, 70),
                               rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[0, 69, 31], [32, 5, 64]])  # columns in the first, a middle and the padded last panel
    np.testing.assert_array_equal(cpu.panel_columns(panels, ids), np.moveaxis(np.asarray(w)[:, ids], 0, -1))


def test_a_rows_product_does_not_depend_on_the_other_rows():
    """A one-token step and a (k + 1)-token verify pass compute each row's products bit for bit alike, wherever the
    row falls among the tiles (the first tile streams the panel, later ones take other shapes): what keeps greedy
    speculative output equal to plain output on the CPU kernels."""
    x, w = random((29, 576), 6), random((576, 960), 7)
    panels = cpu.pack_columns(w)
    packed = jax.jit(cpu.packed_matmul, static_argnums=2)
    alone = np.concatenate([packed(x[i:i + 1], panels, 960) for i in range(29)])
    for m in (2, 4, 5, 8, 9, 10, 14, 15, 16, 29):  # AVX2: 3 rows, then half-panel tiles of 6, the last 1-3 whole
        np.testing.assert_array_equal(packed(x[:m], panels, 960), alone[:m])


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_bfloat16_panels_give_the_float32_panels_sums(M, K, N):
    """Panels in bfloat16 (a drafter's weights, `pack_drafter`) are read as such and widened exactly: the product is
    bitwise that of the same values in float32 panels, and the reference's within rounding."""
    x, w = random((M, K), 0), random((K, N), 1).astype(jnp.bfloat16)
    packed = jax.jit(cpu.packed_matmul, static_argnums=2)
    narrow = packed(x, cpu.pack_columns(w), N)
    np.testing.assert_array_equal(narrow, packed(x, cpu.pack_columns(w.astype(jnp.float32)), N))
    np.testing.assert_allclose(narrow, cpu.packed_matmul_reference(x, cpu.pack_columns(w), N), rtol=1e-5,
                               atol=1e-4 * np.sqrt(K))
    assert narrow.dtype == jnp.float32


def test_a_drafter_packs_in_bfloat16_only_where_that_loses_nothing():
    target = TargetConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                          num_kv_heads=2)
    weights = init_drafter(target, DrafterConfig(num_slots=4), jax.random.key(0)).weights
    as_stored = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), weights)  # a drafter's file
    packed = lambda p: isinstance(p, dict) and "panels" in p
    dtypes = lambda tree: {p["panels"].dtype for p in jax.tree.leaves(tree, is_leaf=packed) if packed(p)}
    assert dtypes(pack_drafter(as_stored)) == {jnp.dtype(jnp.bfloat16)}
    assert dtypes(pack_drafter(jax.tree.map(lambda w: w + 1e-4, as_stored))) == {jnp.dtype(jnp.float32)}
    traced = jax.eval_shape(pack_drafter, as_stored)  # values unknown: kept as they are
    assert dtypes(traced) == {jnp.dtype(jnp.float32)}


def test_gradients_are_the_references():
    x, panels = random((2, 4, 33), 9), cpu.pack_columns(random((33, 50), 10))
    kernel, reference = (lambda x, p: cpu.packed_matmul(x, p, 50)), (lambda x, p: cpu.packed_matmul_reference(x, p, 50))
    got = jax.grad(lambda x, p: jnp.sum(jnp.sin(kernel(x, p))), argnums=(0, 1))(x, panels)
    want = jax.grad(lambda x, p: jnp.sum(jnp.sin(reference(x, p))), argnums=(0, 1))(x, panels)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # CI time: the shipped drafter decodes packed on the CPU kernels as before (test_shipped_drafter.py)
@pytest.mark.parametrize("settings", [{}, {"next_token_input": True, "context_token_input": True,
                                          "slot_attention": "causal"}])
def test_a_packed_drafter_computes_what_it_computes_unpacked(settings):
    """Decoding on a CPU packs the drafter's weights with the target's (`pack_drafter`, once per call): the same
    slot states and cache."""
    target = TargetConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                          num_kv_heads=2)
    cfg = DrafterConfig(num_slots=4, **settings)
    weights = jax.tree.map(lambda w: w + random(w.shape, 1) * 0.1, init_drafter(target, cfg, jax.random.key(0)).weights)
    hidden = {i: random((2, 5, 64), i + 5) for i in cfg.resolved_hooks(target)}
    args = (hidden, drafter_cache(target, 2, 16), None, jnp.asarray([[2], [4]]), 3, random((2, 5, 64), 9))
    packed_target = dataclasses.replace(target, unroll_layers=True, fuse_projections=True, pack_weights=True)
    want = Drafter(target, cfg).apply({"params": weights}, *args)
    got = Drafter(packed_target, cfg, packed=True).apply({"params": pack_drafter(weights)}, *args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1].k, want[1].k, rtol=1e-5, atol=1e-6)


SCRIPT = """
import json, sys
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
model = load_target("random:tiny", dtype="float32")
out = generate(model, [[5, 9, 13, 2, 40]], max_new_tokens=12, batch_size=1, chat=False)
print(json.dumps({"tokens": out.token_ids, "packed": model.cfg.pack_weights}))
"""


def test_without_a_compiler_decoding_runs_on_xla_and_gives_the_same_tokens(tmp_path):
    """A machine where the kernels cannot be built (here: no compiler) decodes with XLA's matmuls, after one line
    saying why; the tokens are those of the kernels."""
    env = dict(os.environ, SPECFORMER_CACHE=str(tmp_path), CXX=str(tmp_path / "no-such-compiler"))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in done.stderr.splitlines() if line.startswith("specformer:")]
    assert len(notes) == 1 and "could not be built" in notes[0] and "XLA's matmuls" in notes[0]
    plain = json.loads(done.stdout)
    assert plain["packed"] is False
    model = load_target("random:tiny", dtype="float32")
    kernels = generate(model, [[5, 9, 13, 2, 40]], max_new_tokens=12, batch_size=1, chat=False)
    assert model.cfg.pack_weights and kernels.token_ids == plain["tokens"]


@pytest.mark.parametrize("march", ["no-such-target", "lacking"])
def test_a_build_target_this_cpu_cannot_run_is_refused_before_building(tmp_path, march):
    """SPECFORMER_CPU_MARCH naming a target the compiler does not know, or one with instruction sets this CPU lacks
    (its library would die on an illegal instruction), is refused in one line; decoding then runs XLA's matmuls."""
    if march == "lacking":
        here = cpu_flags()
        march = next((m for m, need in (("x86-64-v4", "avx512f"), ("sapphirerapids", "amx_tile"))
                      if need not in here), None) if platform.machine() == "x86_64" else None
        if march is None:
            pytest.skip("no x86-64 target here that this CPU lacks")
    script = ("import sys; from pathlib import Path; from pallas_kernels import cpu; "
              "print(cpu.build_cpu_kernels(Path(sys.argv[1])))")
    env = dict(os.environ, SPECFORMER_CPU_MARCH=march)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"SPECFORMER_CPU_MARCH={march}" in done.stdout and "could not be built" in done.stdout
    assert ("does not know" if march == "no-such-target" else "which this CPU lacks") in done.stdout
    assert not list(tmp_path.glob("*.so"))


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECFORMER_CPU_KERNELS", "0")
    assert not cpu_kernels_ready(load_target("random:tiny", dtype="float32").cfg)


WIDTH_SCRIPT = """
import sys
from pathlib import Path
import jax.numpy as jnp
import numpy as np
from pallas_kernels import cpu
from pallas_kernels.reference import ragged_attention_reference
assert cpu.build_cpu_kernels(Path(sys.argv[1])) is None
rng = np.random.default_rng(0)
for M, K, N in %r:
    x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        panels = cpu.pack_columns(jnp.asarray(w)).astype(dtype)
        got = cpu.packed_matmul(jnp.asarray(x), panels, N)
        want = x.astype(np.float64) @ np.asarray(cpu.unpack_columns(panels, N), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.sqrt(K))
        alone = [cpu.packed_matmul(jnp.asarray(x[i:i + 1]), panels, N) for i in range(M)]
        np.testing.assert_array_equal(np.concatenate(alone), got)
lens = jnp.asarray([5, 64, 100], jnp.int32)
q = jnp.asarray(rng.standard_normal((3, 5, 8, 64)), jnp.float32)
k, v = (jnp.asarray(rng.standard_normal((3, 2, 100, 64)), jnp.float32) for _ in "kv")
for window in (None, 32):
    got = cpu.cached_attention(q, k[None], v[None], lens, 0, sliding_window=window)
    want = ragged_attention_reference(q, k, v, lens, sliding_window=window)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
"""
# x86-64 targets by vector width (4, 8 and 16 floats) and the CPU flags each needs
WIDTHS = {"x86-64": set(), "x86-64-v3": {"avx2", "fma"}, "x86-64-v4": {"avx512f", "avx512bw", "avx512vl"}}


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.mark.parametrize("march", sorted(WIDTHS))
def test_every_vector_width_this_cpu_runs_computes_the_same_products(tmp_path, march):
    """The kernels built for SSE2 (vectors of 4 floats, tiles of 1 row), AVX2 (8, 3 rows) and AVX-512 (16, 14 rows)
    where this CPU runs them, whatever -march=native picks here: products against numpy in float64 with float32
    and bfloat16 panels, a row's product the same alone and among others, attention against the reference."""
    if platform.machine() != "x86_64" or not WIDTHS[march] <= cpu_flags():
        pytest.skip(f"this CPU does not run {march}")
    env = dict(os.environ, SPECFORMER_CPU_MARCH=march)
    done = subprocess.run([sys.executable, "-c", WIDTH_SCRIPT % (SHAPES,), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
