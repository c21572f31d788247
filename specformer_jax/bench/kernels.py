"""`specformer bench-kernels`: the Pallas ragged attention kernel against the XLA (jnp) reference at verify shapes.

For every (batch, new tokens Q, cache length) both are jitted, compiled, and timed (median of `repeats` calls).
With chain=N > 1 one jitted call runs N attention calls in a row, each query depending on the previous output (by an
amount too small to change it), and the time is divided by N: the per-call dispatch and synchronisation then drop
out, which matters at small shapes, where they cost more than the attention itself. The calls of a chain cycle
through enough distinct K/V buffers (`num_buffers`) that the cache is read from memory, as in a decode step whose
layers each read their own cache; single calls (chain=1) reuse one buffer, which a small cache may find in L2.
Every row's cache is full to the given length, so a call must read B * Hkv * length * D * 2 elements of K and V:
that many bytes (plus q and the output) over the time is the achieved bandwidth, reported against the device's
measured read bandwidth. The GPU kernel runs with its own split-KV choice (`pallas_kernels.gpu.auto_num_splits`),
recorded per shape as `num_splits` (null for kernels that do not split).
"""

from __future__ import annotations

import platform
import statistics
import sys
from typing import Callable

import flax
import jax
import jax.numpy as jnp

from pallas_kernels import GPU_BLOCK_K, ragged_attention, resolve
from specformer_jax.bench.roofline import call_times, measure_device

COLD_BYTES = 256 * 2**20  # K/V read by a chain before it comes back to the same buffer: 5x an H100's or H200's L2


def chained(which: str, chain: int):
    """attention(q, ks[i], vs[i], lengths) for i < `chain`, in one function, each query nudged by the last output.
    Call i reads K/V buffer i % len(ks): with enough distinct buffers a chain reads its K/V from memory, not from a
    cache that the previous call warmed (an 8k cache at batch 1 is 34 MB, inside a GPU's L2)."""

    def run(q, ks, vs, lens):
        o = ragged_attention(q, ks[0], vs[0], lens, impl=which)
        for i in range(1, chain):  # unrolled: no loop control between the calls
            o = ragged_attention(q + (o * 1e-30).astype(q.dtype), ks[i % len(ks)], vs[i % len(vs)], lens, impl=which)
        return o

    return run


def num_buffers(chain: int, kv_bytes: int) -> int:
    """Distinct K/V buffers for a chain: enough that it reads COLD_BYTES before reusing one, at most one per call."""
    return max(1, min(chain, -(-COLD_BYTES // kv_bytes)))


def run_kernel_benchmark(*, batch_sizes, queries, cache_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                         dtype="bfloat16", impl="pallas", repeats=20, chain=1, log=sys.stderr,
                         on_progress: Callable[[dict], None] | None = None) -> dict:
    """The result document; `on_progress` gets it after every shape ("complete": false until the last)."""
    dt = jnp.dtype(dtype)
    rows = []
    doc = {
        "impl": impl, "dtype": dtype, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "repeats": repeats, "chain": chain, "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "device_measured": measure_device(dtype),
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": rows,
        "complete": False,
    }
    device = doc["device_measured"]
    num_shapes = len(batch_sizes) * len(queries) * len(cache_lens)
    for B in batch_sizes:
        for Q in queries:
            for S in cache_lens:
                kv_bytes = 2 * B * num_kv_heads * S * head_dim * dt.itemsize
                nbuf = num_buffers(chain, kv_bytes)
                keys = jax.random.split(jax.random.key(0), 1 + 2 * nbuf)
                q = jax.random.normal(keys[0], (B, Q, num_heads, head_dim), dt)
                ks, vs = ([jax.random.normal(kk, (B, num_kv_heads, S, head_dim), dt) for kk in keys[1 + j::2]]
                          for j in range(2))
                lengths = jnp.full((B,), S, jnp.int32)
                times = {}
                for name, which in (("reference", "reference"), ("kernel", impl)):
                    fn = jax.jit(chained(which, chain))
                    times[name] = statistics.median(call_times(fn, (q, ks, vs, lengths), repeats)) / chain
                splits = None
                if resolve(impl, head_dim) in ("gpu", "interpret"):
                    from pallas_kernels.gpu import num_splits_for

                    splits = num_splits_for(q, ks[0], block_k=GPU_BLOCK_K)
                moved = kv_bytes + 2 * B * Q * num_heads * head_dim * dt.itemsize
                row = {"batch_size": B, "new_tokens": Q, "cache_len": S, "num_splits": splits, "bytes": moved,
                       "kv_buffers": nbuf,
                       "reference_seconds": times["reference"], "kernel_seconds": times["kernel"],
                       "speedup": times["reference"] / times["kernel"],
                       "kernel_gb_per_s": moved / times["kernel"] / 1e9,
                       "fraction_of_read_bandwidth": moved / times["kernel"] / 1e9 / device["read_bandwidth_gb_per_s"]}
                rows.append(row)
                if log:
                    split_note = f" in {splits} splits" if splits and splits > 1 else ""
                    print(f"specformer bench-kernels: B={B} Q={Q} S={S}: reference {1e6 * times['reference']:.0f} us, "
                          f"kernel {1e6 * times['kernel']:.0f} us{split_note} ({row['speedup']:.2f}x, "
                          f"{row['kernel_gb_per_s']:.0f} GB/s = {100 * row['fraction_of_read_bandwidth']:.0f}% "
                          "of read)", file=log)
                doc["complete"] = len(rows) == num_shapes
                if on_progress:
                    on_progress(doc)
    return doc
