"""Device mesh and shardings. Today: data parallel over every device (batch split, parameters replicated)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def data_mesh() -> Mesh:
    """A 1-D 'data' mesh over all devices (Auto axis type: the classic GSPMD propagation)."""
    return Mesh(np.asarray(jax.devices()), ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P("data"))
