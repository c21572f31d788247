"""Attention kernels for SpecFormer's hybrid causal/bidirectional attention, with jnp references.

This package imports only jax. `ragged_attention` is the entry point the models call: new query tokens against a KV
cache with per-row valid lengths, causal with an offset (verify, decode, chunked prefill) or bidirectional inside
the appended block. `impl` picks the implementation:

  auto           Pallas on TPU (Mosaic) and GPU (Triton), the jnp reference elsewhere (CPU) or for shapes a
                 kernel does not take (GPU: head_dim a power of two >= 16)
  cpu            the C++ kernel of cpu.py (a CPU; float32, head_dim a multiple of 16, else the reference), what
                 the target's packed CPU decoding layout runs
  reference      the jnp reference
  pallas         the kernel for the current backend (TPU or GPU; an error on CPU)
  pallas_tpu     the Mosaic kernel, whatever the current backend (to export or lower for TPU from a CPU)
  pallas_gpu     the Triton kernel, likewise (to lower for CUDA from a CPU)
  interpret      the GPU kernel under Pallas' generic interpreter (any backend; for tests)
  interpret_tpu  the TPU kernel under the TPU interpreter (any backend; for tests)

Every implementation is differentiable (the drafter's context layer trains through it): each kernel has a fused
flash-style backward, attached as a custom VJP.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.cpu import cached_attention
from pallas_kernels.reference import ragged_attention_reference

GPU_BLOCK_K, TPU_BLOCK_K = 64, 128  # KV positions per tile
IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu", "interpret", "interpret_tpu", "cpu")


def resolve(impl: str, head_dim: int) -> str | None:
    """Which kernel `impl` runs on the current backend: "gpu", "tpu", their "interpret" variants, "cpu" (cpu.py), or
    None (the reference)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {', '.join(IMPLS)}")
    backend = jax.default_backend()
    if impl == "cpu" and backend != "cpu":
        raise ValueError(f"attention_impl='cpu' needs a CPU; this is {backend}: use 'auto'")
    if impl in ("reference", "interpret", "interpret_tpu", "cpu"):
        return None if impl == "reference" else impl
    if impl == "pallas_tpu" or (impl in ("auto", "pallas") and backend == "tpu"):
        return "tpu"
    if impl == "pallas_gpu" or (backend == "gpu" and head_dim >= 16 and head_dim & (head_dim - 1) == 0):
        return "gpu"
    if impl == "pallas":
        raise ValueError(f"attention_impl='pallas' needs a TPU or a GPU (and on GPU a power-of-two head_dim >= 16); "
                         f"this is {backend} with head_dim {head_dim}: use 'auto', 'reference' or 'interpret'")
    return None


def cache_block(impl: str, head_dim: int) -> int:
    """KV caches should hold a multiple of this many positions, so the kernel never pads (copies) them."""
    kernel = resolve(impl, head_dim)
    blocks = {"gpu": GPU_BLOCK_K, "interpret": GPU_BLOCK_K, "tpu": TPU_BLOCK_K, "interpret_tpu": TPU_BLOCK_K}
    return blocks.get(kernel, 1)


def ragged_attention(q, k, v, lengths, *, causal=True, sliding_window=None, scale=None, impl="auto", num_splits=None,
                     layer=None, rows=None):
    """q [B, Q, H, D]; k, v [B', Hkv, S, D] (B' >= B: row b of q against row b of the cache, so a pool's first B
    rows decode without copying the cache out on a CPU); lengths int32[B]: valid cache entries per row, the Q new
    tokens included (they sit at positions lengths - Q + t). Returns [B, Q, H, D]. See `ragged_attention_reference`
    for the masks. layer: k and v are stacked caches [L, B', Hkv, S, D] and this layer's is attended to (the CPU
    kernel reads it in place; the others take it, and the first B rows, out of the stack). num_splits: the GPU
    kernel's split-KV count (None: its own choice, `pallas_kernels.gpu.auto_num_splits`); the others ignore it.
    rows: int32[B], the cache row each query row reads (default b; any B' then): the flat layout of a verify pass,
    Q = 1 and one query row per position, a request's positions on consecutive rows (the CPU kernel reads such a
    run's keys once). Inference only: no gradient flows through a call with rows."""
    kw = dict(causal=causal, sliding_window=sliding_window, scale=scale)
    kernel = resolve(impl, q.shape[-1])
    if kernel == "cpu":
        stacked = (k, v) if layer is not None else (k[None], v[None])
        return cached_attention(q, *stacked, lengths, 0 if layer is None else layer, rows=rows, **kw)
    if layer is not None:
        k, v = k[layer], v[layer]
    if rows is not None:
        return _rows_attention(q, k, v, lengths, rows, kernel, num_splits, **kw)
    k, v = k[: q.shape[0]], v[: q.shape[0]]  # the Pallas kernels take as many cache rows as query rows
    if kernel is None:
        return ragged_attention_reference(q, k, v, lengths, **kw)
    return _kernel_attention(q, k, v, lengths, kernel, num_splits, **kw)


def _rows_attention(q, k, v, lengths, rows, kernel, num_splits, **kw):
    """A call with `rows` (the flat layout) on the reference or a Pallas kernel: forward only."""
    if kernel is None:
        return ragged_attention_reference(q, k, v, lengths, rows=rows, **kw)
    if kernel in ("gpu", "interpret"):
        from pallas_kernels.gpu import ragged_attention_gpu_fwd as forward

        kw = dict(kw, block_k=GPU_BLOCK_K, interpret=kernel == "interpret", num_splits=num_splits)
    else:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.tpu import ragged_attention_tpu_fwd as forward

        kw = dict(kw, block_k=TPU_BLOCK_K, interpret=pltpu.InterpretParams() if kernel == "interpret_tpu" else None)
    return jax.lax.stop_gradient(forward(q, k, v, lengths, rows=rows, **kw)[0])  # the kernels read rows in place


def _kernel_attention(q, k, v, lengths, kernel: str, num_splits, **kw):
    """A Pallas kernel's forward pass with its fused backward as the custom VJP."""
    if kernel in ("gpu", "interpret"):
        from pallas_kernels.gpu import ragged_attention_gpu_bwd as backward
        from pallas_kernels.gpu import ragged_attention_gpu_fwd

        kw = dict(kw, block_k=GPU_BLOCK_K, interpret=kernel == "interpret")
        forward = functools.partial(ragged_attention_gpu_fwd, num_splits=num_splits)  # the backward needs no splits
    else:
        from jax.experimental.pallas import tpu as pltpu

        from pallas_kernels.tpu import ragged_attention_tpu_bwd as backward
        from pallas_kernels.tpu import ragged_attention_tpu_fwd as forward

        kw = dict(kw, block_k=TPU_BLOCK_K, interpret=pltpu.InterpretParams() if kernel == "interpret_tpu" else None)

    @jax.custom_vjp
    def attend(q, k, v, lengths):
        return forward(q, k, v, lengths, **kw)[0]

    def fwd(q, k, v, lengths):
        return forward(q, k, v, lengths, **kw)

    def bwd(res, g):
        dq, dk, dv = backward(res, g, num_heads=q.shape[2], **kw)
        S = k.shape[2]
        return dq, dk[:, :, :S], dv[:, :, :S], None

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, lengths)


__all__ = ["IMPLS", "cache_block", "ragged_attention", "ragged_attention_reference", "resolve"]
