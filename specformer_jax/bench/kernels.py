"""`specformer bench-kernels`: the Pallas ragged attention kernel against the XLA (jnp) reference at verify shapes.

For every (batch, new tokens Q, cache length) both are jitted, compiled, and timed (median of `repeats` calls).
With chain=N > 1 one jitted call runs N attention calls in a row, each query depending on the previous output (by an
amount too small to change it), and the time is divided by N: the per-call dispatch and synchronisation then drop
out, which matters at small shapes, where they cost more than the attention itself.
Every row's cache is full to the given length, so a call must read B * Hkv * length * D * 2 elements of K and V:
that many bytes (plus q and the output) over the time is the achieved bandwidth, reported against the device's
measured copy bandwidth. The GPU kernel runs with its own split-KV choice (`pallas_kernels.gpu.auto_num_splits`),
recorded per shape as `num_splits` (null for kernels that do not split).
"""

from __future__ import annotations

import platform
import statistics
import sys

import flax
import jax
import jax.numpy as jnp

from pallas_kernels import GPU_BLOCK_K, ragged_attention, resolve
from specformer_jax.bench.roofline import call_times, measure_device


def chained(which: str, chain: int):
    """attention(q, k, v, lengths) `chain` times in one function, each query nudged by the last output."""

    def run(q, k, v, lens):
        o = ragged_attention(q, k, v, lens, impl=which)
        for _ in range(chain - 1):  # unrolled: no loop control between the calls
            o = ragged_attention(q + (o * 1e-30).astype(q.dtype), k, v, lens, impl=which)
        return o

    return run


def run_kernel_benchmark(*, batch_sizes, queries, cache_lens, num_heads=32, num_kv_heads=8, head_dim=128,
                         dtype="bfloat16", impl="pallas", repeats=20, chain=1, log=sys.stderr) -> dict:
    dt = jnp.dtype(dtype)
    device = measure_device(dtype)
    rows = []
    for B in batch_sizes:
        for Q in queries:
            for S in cache_lens:
                keys = jax.random.split(jax.random.key(0), 3)
                q = jax.random.normal(keys[0], (B, Q, num_heads, head_dim), dt)
                k = jax.random.normal(keys[1], (B, num_kv_heads, S, head_dim), dt)
                v = jax.random.normal(keys[2], (B, num_kv_heads, S, head_dim), dt)
                lengths = jnp.full((B,), S, jnp.int32)
                times = {}
                for name, which in (("reference", "reference"), ("kernel", impl)):
                    fn = jax.jit(chained(which, chain))
                    times[name] = statistics.median(call_times(fn, (q, k, v, lengths), repeats)) / chain
                splits = None
                if resolve(impl, head_dim) in ("gpu", "interpret"):
                    from pallas_kernels.gpu import num_splits_for

                    splits = num_splits_for(q, k, block_k=GPU_BLOCK_K)
                moved = (2 * B * num_kv_heads * S + 2 * B * Q * num_heads) * head_dim * dt.itemsize
                row = {"batch_size": B, "new_tokens": Q, "cache_len": S, "num_splits": splits, "bytes": moved,
                       "reference_seconds": times["reference"], "kernel_seconds": times["kernel"],
                       "speedup": times["reference"] / times["kernel"],
                       "kernel_gb_per_s": moved / times["kernel"] / 1e9,
                       "fraction_of_copy_bandwidth": moved / times["kernel"] / 1e9 / device["copy_bandwidth_gb_per_s"]}
                rows.append(row)
                if log:
                    split_note = f" in {splits} splits" if splits and splits > 1 else ""
                    print(f"specformer bench-kernels: B={B} Q={Q} S={S}: reference {1e6 * times['reference']:.0f} us, "
                          f"kernel {1e6 * times['kernel']:.0f} us{split_note} ({row['speedup']:.2f}x, "
                          f"{row['kernel_gb_per_s']:.0f} GB/s = {100 * row['fraction_of_copy_bandwidth']:.0f}% of copy)",
                          file=log)
    return {
        "impl": impl, "dtype": dtype, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "repeats": repeats, "chain": chain, "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
        "device_measured": device,
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__},
        "results": rows,
    }
