"""Device mesh, logical-axis rules and shardings for training and decoding.

The mesh always has the axes ("data", "fsdp", "tensor") (size 1 when unused), all of type Auto (GSPMD propagation;
JAX 0.10's make_mesh defaults to Explicit). Every weight declares its logical axes where it is declared
(modeling/layers.py, `with_axes`: embed, heads, kv_heads, mlp, vocab, or None); `RULES` maps logical axes to mesh
axes:

  batch -> (data, fsdp)   every batch-like dimension: sequences in training, rows in decoding, KV-cache rows
  embed -> fsdp           the model width of every weight matrix: FSDP shards parameters (and optimizer state)
  heads, kv_heads, mlp, vocab -> tensor   Megatron-style tensor parallelism

A dimension that its mesh axes do not divide stays replicated, so any model runs on any mesh.

Several processes (hosts): specformer_jax.distributed joins them; `put_global`, `put_process_batch` and `to_host` here
move host data to and from meshes that span processes.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specformer_jax.errors import SpecformerError

AXES = ("data", "fsdp", "tensor")
RULES: Mapping[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}

def parse_mesh(spec: str | None) -> dict[str, int]:
    """"data=2,fsdp=2,tensor=2" -> sizes; -1 (at most one axis) takes the remaining devices. Default: all data.
    A mesh smaller than the device count uses the first devices."""
    sizes = {a: 1 for a in AXES}
    items = [s for s in (spec or "data=-1").split(",") if s.strip()]
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise SpecformerError(f"mesh: expected axis=size with axes {', '.join(AXES)}, got {item!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise SpecformerError(f"mesh: size of {name} must be an integer, got {value!r}") from None
    fill = [a for a, n in sizes.items() if n == -1]
    if len(fill) > 1 or any(n < 1 and n != -1 for n in sizes.values()):
        raise SpecformerError(f"mesh {spec!r}: sizes must be >= 1, with at most one -1")
    devices = jax.device_count()
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if fill:
        if devices % fixed:
            raise SpecformerError(f"mesh {spec!r}: {devices} devices are not a multiple of {fixed}")
        sizes[fill[0]] = devices // fixed
    if math.prod(sizes.values()) > devices:
        raise SpecformerError(f"mesh {spec!r} needs {math.prod(sizes.values())} devices but there are {devices}")
    return sizes


def make_mesh(spec: str | None = None) -> Mesh:
    sizes = parse_mesh(spec)
    shape = tuple(sizes[a] for a in AXES)
    if jax.process_count() > 1 and math.prod(shape) != jax.device_count():
        raise SpecformerError(f"mesh {spec!r} uses {math.prod(shape)} of the {jax.device_count()} devices; a run of "
                              f"{jax.process_count()} processes must use them all")
    devices = np.asarray(jax.devices()[: math.prod(shape)]).reshape(shape)  # a smaller mesh takes the first devices
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, P(RULES["batch"]))


def _spec(mesh: Mesh, shape, logical) -> P:
    """PartitionSpec for `shape` whose trailing dims have these logical axes; undivisible dims stay replicated."""
    logical = (None,) * (len(shape) - len(logical)) + tuple(logical)
    out = []
    for dim, name in zip(shape, logical):
        axes = tuple(a for a in RULES.get(name, ()) if mesh.shape[a] > 1) if name else ()
        out.append(axes if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0 else None)
    return P(*out)


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_shardings(params, axes, mesh: Mesh):
    """NamedShardings for a parameter tree from the logical axes its weights declare (`axes`: a tree like `params`
    of PartitionSpecs of logical axis names, as modeling's target_axes and drafter_axes give)."""
    return jax.tree.map(lambda x, logical: NamedSharding(mesh, _spec(mesh, x.shape, logical)), params, axes)


def decode_state_shardings(state, mesh: Mesh):
    """NamedShardings for a decoding pool (a pytree of ShapeDtypeStructs or arrays): rows over the batch axes, KV
    caches [L, rows, Hkv, S, D] also heads over tensor, scalars replicated."""

    def one(path, leaf):
        names = _path_names(path)
        if not leaf.ndim:
            return NamedSharding(mesh, P())
        logical = ((None, "batch", "kv_heads", None, None) if names[-1] in ("k", "v") and leaf.ndim == 5
                   else ("batch",) + (None,) * (leaf.ndim - 1))
        return NamedSharding(mesh, _spec(mesh, leaf.shape, logical))

    return jax.tree_util.tree_map_with_path(one, state)


# Placing host data on a mesh that may span several processes. In a single process these are jax.device_put and
# jax.device_get; with several, device_put would insist that every process passes the same value.

def put_global(tree, shardings):
    """Values that are the same on every process (parameters, evaluation batches) onto their shardings.
    `shardings`: a tree like `tree`, or one Sharding for every leaf."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x, sharding):
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: np.asarray(host[index]))

    return jax.tree.map(one, tree, shardings)


def put_process_batch(batch, mesh: Mesh):
    """This process's rows of a global batch (each process passes its own share, all the same size) as global
    arrays sharded over the batch axes: the global batch is the processes' shares in process order."""
    if jax.process_count() == 1:
        return jax.device_put(batch, batch_sharded(mesh))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharded(mesh), np.asarray(x)), batch)


def to_host(tree):
    """Whole numpy values of (possibly sharded) arrays on this process. With several processes this is a collective:
    every process must call it."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def barrier(name: str) -> None:
    """Wait until every process gets here (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
