"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU, and dense layers whose weights
declare their logical sharding axes where they are declared (`with_axes`, `dense`; parallel.py maps the axes to a
mesh: batch, embed, heads, kv_heads, mlp, vocab, or None for a dimension that is never split)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec

from pallas_kernels.cpu import PANEL, pack_columns, packed_matmul, panel_columns, panel_count


def array_module(x: jax.Array):
    """numpy for a concrete array, jnp under a trace: what re-laying weights out once (packing, narrowing) computes
    with, so that a concrete array's work runs on the host and compiles nothing (jnp's operations would compile a
    program per shape the first time: seconds for a drafter's dozen matrices)."""
    return jnp if isinstance(x, jax.core.Tracer) else np


def packed_columns(w: jax.Array) -> jax.Array:
    """w [K, N] as the CPU kernels' column panels (`pack_columns`), packed with `array_module(w)`."""
    xp = array_module(w)
    panels = pack_columns(xp.asarray(w), xp)
    return panels if xp is jnp else jnp.asarray(np.ascontiguousarray(panels))


def with_axes(init, *axes: str | None):
    """The initializer `init` for a weight whose dimensions have these logical axes: `Module.init` returns the
    weight boxed with them (flax's LogicallyPartitioned), `logical_axes` reads them back."""
    return nn.with_logical_partitioning(init, axes)


def dense(features: int, dtype, axes: tuple, *, bias: bool = False, name: str | None = None,
          kernel_init=nn.linear.default_kernel_init, packed: bool = False) -> nn.Module:
    """nn.Dense in `dtype` whose kernel [in, features] has the logical axes `axes` (its bias the last one); with
    `packed`, the same layer with its kernel held as column panels (`PackedDense`)."""
    if packed:
        return PackedDense(features, dtype, axes, bias, name=name)
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=with_axes(kernel_init, *axes),
                    bias_init=with_axes(nn.initializers.zeros_init(), *axes[-1:]))


class PackedDense(nn.Module):
    """A dense layer whose kernel [in, features] is held as column panels "panels" [P, in, PANEL]
    (pallas_kernels.cpu.pack_columns) and multiplied by the CPU matmul kernel: the packed decoding layout."""

    features: int
    dtype: Any
    axes: tuple  # the kernel's logical axes (in, out), as `dense`'s
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=(0, 2))
        shape = (panel_count(self.features), x.shape[-1], PANEL)
        panels = self.param("panels", with_axes(init, None, self.axes[0], None), shape, self.dtype)
        y = packed_matmul(x.astype(self.dtype), panels, self.features)
        if self.bias:
            y = y + self.param("bias", with_axes(nn.initializers.zeros_init(), self.axes[-1]), (self.features,),
                               self.dtype)
        return y


class PackedEmbed(nn.Module):
    """An embedding matrix [num_embeddings, features] held as the column panels "panels" of its transpose (as
    PackedDense holds a [features, num_embeddings] kernel): token lookups read a column of the panels, and the
    tied LM head (`attend`) is one packed product. The packed decoding layout's embedding."""

    num_embeddings: int
    features: int
    dtype: Any

    def setup(self):
        shape = (panel_count(self.num_embeddings), self.features, PANEL)
        init = nn.initializers.normal(stddev=1.0)
        self.panels = self.param("panels", with_axes(init, None, "embed", None), shape, self.dtype)

    def __call__(self, tokens):
        return panel_columns(self.panels, tokens).astype(self.dtype)

    def attend(self, x):
        return packed_matmul(x.astype(self.dtype), self.panels, self.num_embeddings)


def logical_axes(boxed) -> dict:
    """The logical axes of every weight of an `init`'s output (boxed by `with_axes`), as PartitionSpecs of axis
    names. A weight declared without them is an error: sharding it would mean guessing."""

    def one(path, leaf):
        if not isinstance(leaf, nn.LogicallyPartitioned):
            raise ValueError(f"weight {jax.tree_util.keystr(path)} declares no logical axes (modeling/layers.py, "
                             "with_axes)")
        return PartitionSpec(*leaf.names)

    return jax.tree_util.tree_map_with_path(one, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", with_axes(nn.initializers.ones, None), (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


def rope_table(positions, inv_freq: np.ndarray, length: int) -> tuple[jax.Array, jax.Array]:
    """RoPE's cos and sin at `positions` (int32[B, T], each below `length`; inv_freq: static [D/2]), each
    [B, T, 1, D/2], read from a table of every position below `length` made once when the step is traced. Computed
    in the step instead, XLA's CPU fusion evaluates the cosine and sine again inside every layer's rotation, for
    every head and element. The angles are float32 products, as transformers makes them."""
    cos, sin = _rope_angles(length, tuple(np.asarray(inv_freq, np.float32).tolist()))
    at = lambda table: jnp.take(table, positions, axis=0, mode="clip")[:, :, None, :]
    return at(cos), at(sin)


@functools.lru_cache(maxsize=32)
def _rope_angles(length: int, inv_freq: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(length, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    return np.cos(angles), np.sin(angles)


def rope(x, table: tuple[jax.Array, jax.Array]):
    """Rotate-half RoPE. x: [B, T, H, D]; table: `rope_table` at x's positions."""
    cos, sin = table
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class SwiGLU(nn.Module):
    hidden: int
    intermediate: int
    dtype: jnp.dtype = jnp.float32
    # gate and up as one matmul over a [d, 2, intermediate] kernel "gate_up" (one read of x, one larger matmul)
    fused: bool = False
    packed: bool = False  # the kernels as column panels (PackedDense; fused: gate_up's [d, 2 * intermediate])

    @nn.compact
    def __call__(self, x):
        if self.packed:
            gate_up = dense(2 * self.intermediate, self.dtype, ("embed", "mlp"), name="gate_up", packed=True)(x)
            gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate:]
        elif self.fused:
            gate_up = nn.DenseGeneral((2, self.intermediate), use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                      kernel_init=with_axes(nn.linear.default_kernel_init, "embed", None, "mlp"),
                                      name="gate_up")(x)
            gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        else:
            gate = dense(self.intermediate, self.dtype, ("embed", "mlp"), name="gate")(x)
            up = dense(self.intermediate, self.dtype, ("embed", "mlp"), name="up")(x)
        return dense(self.hidden, self.dtype, ("mlp", "embed"), name="down", packed=self.packed)(nn.silu(gate) * up)
