"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


def rope(x, positions, inv_freq: np.ndarray):
    """Rotate-half RoPE. x: [B, T, H, D]; positions: int32[B, T]; inv_freq: static [D/2]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class SwiGLU(nn.Module):
    hidden: int
    intermediate: int
    dtype: jnp.dtype = jnp.float32
    # gate and up as one matmul over a [d, 2, intermediate] kernel "gate_up" (one read of x, one larger matmul)
    fused: bool = False

    @nn.compact
    def __call__(self, x):
        dense = lambda n, name: nn.Dense(n, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name=name)
        if self.fused:
            gate_up = nn.DenseGeneral((2, self.intermediate), use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                                      name="gate_up")(x)
            gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        else:
            gate, up = dense(self.intermediate, "gate")(x), dense(self.intermediate, "up")(x)
        return dense(self.hidden, "down")(nn.silu(gate) * up)
