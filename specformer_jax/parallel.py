"""Device mesh, logical-axis rules and shardings for training and decoding.

The mesh always has the axes ("data", "fsdp", "tensor") (size 1 when unused), all of type Auto (GSPMD propagation;
JAX 0.10's make_mesh defaults to Explicit). Parameters are described by logical axes (embed, heads, kv_heads, mlp,
vocab) derived from their names; `RULES` maps logical axes to mesh axes:

  batch -> (data, fsdp)   every batch-like dimension: sequences in training, rows in decoding, KV-cache rows
  embed -> fsdp           the model width of every weight matrix: FSDP shards parameters (and optimizer state)
  heads, kv_heads, mlp, vocab -> tensor   Megatron-style tensor parallelism

A dimension that its mesh axes do not divide stays replicated, so any model runs on any mesh.

Several processes (hosts): `initialize_distributed` joins them (explicit SPECFORMER_* settings, SLURM, TPU pods), and
`put_global`, `put_process_batch`, `to_host` move host data to and from meshes that span processes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
from typing import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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

# (module, parameter) -> logical axes of the trailing dimensions (stacked layers add leading unsharded dims)
_PARAM_AXES = {
    ("q", "kernel"): ("embed", "heads"), ("k", "kernel"): ("embed", "kv_heads"),
    ("v", "kernel"): ("embed", "kv_heads"), ("o", "kernel"): ("heads", "embed"),
    ("q", "bias"): ("heads",), ("k", "bias"): ("kv_heads",), ("v", "bias"): ("kv_heads",),
    ("gate", "kernel"): ("embed", "mlp"), ("up", "kernel"): ("embed", "mlp"), ("down", "kernel"): ("mlp", "embed"),
    ("embed", "embedding"): ("vocab", "embed"), ("lm_head", "kernel"): ("embed", "vocab"),
    ("fuse", "kernel"): (None, "embed"), ("expand", "kernel"): ("embed", None),
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


def data_mesh() -> Mesh:
    """All devices on the data axis."""
    return make_mesh("data=-1")


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


def param_shardings(params, mesh: Mesh):
    """NamedShardings for a target or drafter parameter tree (by parameter names; unknown ones replicated)."""

    def one(path, leaf):
        names = _path_names(path)
        logical = _PARAM_AXES.get(names[-2:], ()) if len(names) >= 2 else ()
        return NamedSharding(mesh, _spec(mesh, leaf.shape, logical) if logical else P())

    return jax.tree_util.tree_map_with_path(one, params)


def like_params(tree, params, mesh: Mesh):
    """Shardings for a tree that embeds copies of the parameter tree (an optimizer state): a leaf whose key path
    ends with a parameter's path and has its shape gets that parameter's sharding; everything else is replicated."""
    by_path = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        by_path[_path_names(path)] = leaf.shape
    specs = {p: s.spec for p, s in zip(by_path, jax.tree.leaves(param_shardings(params, mesh)))}

    def one(path, leaf):
        names = _path_names(path)
        for start in range(len(names)):
            key = names[start:]
            if key in specs and by_path[key] == getattr(leaf, "shape", None):
                return NamedSharding(mesh, specs[key])
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, tree)


def cache_shardings(cache, mesh: Mesh):
    """A KVCache [L, B, Hkv, S, D] (and lengths [B]): rows over batch axes, KV heads over tensor."""
    kv = NamedSharding(mesh, _spec(mesh, cache.k.shape, (None, "batch", "kv_heads", None, None)))
    return type(cache)(kv, kv, NamedSharding(mesh, _spec(mesh, cache.lengths.shape, ("batch",))))


# ---------------------------------------------------------------------------------------------------------------------
# Several processes (hosts). jax.distributed must be initialized before anything touches a JAX device; after that,
# jax.devices() lists the devices of every process and a Mesh built from it spans them all.

INIT_TIMEOUT_S = 120  # default bound on the wait for every process to join (SPECFORMER_INIT_TIMEOUT overrides)
_JAX_EXTRA_WAIT_S = 15  # JAX's own timeout (it aborts the process) comes this much after ours (a one-line error)


@dataclasses.dataclass(frozen=True)
class DistributedSetup:
    """How this process joins the others. `how`: none (a single process), explicit (coordinator, process count and
    id given), slurm / tpu / auto (JAX reads them from the cluster environment)."""

    how: str = "none"
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = INIT_TIMEOUT_S

    def jax_kwargs(self) -> dict:
        explicit = {"coordinator_address": self.coordinator, "num_processes": self.num_processes,
                    "process_id": self.process_id} if self.how == "explicit" else {}
        return {**explicit, "initialization_timeout": self.timeout_s + _JAX_EXTRA_WAIT_S}

    def describe(self) -> str:
        if self.how == "explicit":
            return f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator}"
        return {"slurm": "SLURM job", "tpu": "TPU pod", "auto": "SPECFORMER_DISTRIBUTED=auto"}.get(self.how, self.how)


def _int_setting(name: str, value, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise SpecformerError(f"{name} must be an integer, got {value!r}") from None
    if number < minimum:
        raise SpecformerError(f"{name} must be >= {minimum}, got {number}")
    return number


def _check_coordinator(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecformerError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:8476), got {address!r}")
    return address


def _explicit_setup(coordinator, num_processes, process_id, timeout_s: int) -> DistributedSetup:
    count = _int_setting("number of processes (SPECFORMER_NUM_PROCESSES / --num-processes)", num_processes, 1)
    rank = _int_setting("process id (SPECFORMER_PROCESS_ID / --process-id)", process_id, 0)
    if count is None:
        raise SpecformerError("a coordinator or process id was given without the number of processes: "
                              "set SPECFORMER_NUM_PROCESSES (or --num-processes)")
    if rank is not None and rank >= count:
        raise SpecformerError(f"process id {rank} is out of range for {count} processes (ids 0..{count - 1})")
    if count == 1:
        return DistributedSetup(timeout_s=timeout_s)
    if not coordinator or rank is None:
        raise SpecformerError(f"{count} processes need a coordinator HOST:PORT and this process's id: set "
                              "SPECFORMER_COORDINATOR and SPECFORMER_PROCESS_ID (or --coordinator, --process-id)")
    return DistributedSetup("explicit", _check_coordinator(coordinator), count, rank, timeout_s)


def _cluster_kind(env: Mapping[str, str]) -> str | None:
    """'slurm' inside a SLURM job of several tasks, 'tpu' on a multi-host TPU slice, else None."""
    try:
        slurm_tasks = int(env.get("SLURM_NTASKS", "1"))
    except ValueError:
        slurm_tasks = 1
    if "SLURM_JOB_ID" in env and slurm_tasks > 1:
        return "slurm"
    tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", env.get("TPU_PROCESS_ADDRESSES", "")).split(",") if h]
    if len(tpu_hosts) > 1 or any(k in env for k in ("MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES")):
        return "tpu"
    return None


def distributed_setup(env: Mapping[str, str], coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None) -> DistributedSetup:
    """Decide how to start (pure: reads only `env` and the arguments, which win over the SPECFORMER_* variables).

    SPECFORMER_COORDINATOR, SPECFORMER_NUM_PROCESSES, SPECFORMER_PROCESS_ID: explicit setup (launch/local.sh sets them).
    SPECFORMER_DISTRIBUTED=auto: let JAX detect the cluster (launch/tpu_pod.sh sets it); =off: stay one process.
    Otherwise a SLURM job of several tasks or a multi-host TPU environment is detected; else a single process.
    SPECFORMER_INIT_TIMEOUT: seconds to wait for every process to join (default 120)."""
    timeout_s = _int_setting("SPECFORMER_INIT_TIMEOUT", env.get("SPECFORMER_INIT_TIMEOUT"), 1) or INIT_TIMEOUT_S
    coordinator = coordinator or env.get("SPECFORMER_COORDINATOR") or None
    num_processes = num_processes if num_processes is not None else env.get("SPECFORMER_NUM_PROCESSES")
    process_id = process_id if process_id is not None else env.get("SPECFORMER_PROCESS_ID")
    mode = env.get("SPECFORMER_DISTRIBUTED", "").strip().lower()
    if mode not in ("", "auto", "off"):
        raise SpecformerError(f"SPECFORMER_DISTRIBUTED must be auto or off, got {mode!r}")
    explicit = any(v not in (None, "") for v in (coordinator, num_processes, process_id))
    if explicit and mode == "off":
        raise SpecformerError("SPECFORMER_DISTRIBUTED=off contradicts the coordinator/process settings given")
    if explicit:
        return _explicit_setup(coordinator, num_processes, process_id, timeout_s)
    if mode == "off":
        return DistributedSetup(timeout_s=timeout_s)
    how = "auto" if mode == "auto" else _cluster_kind(env)
    return DistributedSetup(how, timeout_s=timeout_s) if how else DistributedSetup(timeout_s=timeout_s)


def _exit_with(message: str) -> None:
    """The CLI's one-line error, from a thread: the main thread is blocked inside JAX's C++ start-up."""
    sys.stderr.write(f"specformer: error: {message}\n")
    sys.stderr.flush()
    os._exit(2)


def _timeout_message(setup: DistributedSetup) -> str:
    if setup.how == "explicit":
        return (f"process {setup.process_id} of {setup.num_processes}: not every process joined the coordinator "
                f"{setup.coordinator} within {setup.timeout_s} s (a process did not start or failed, or the processes "
                "disagree on the coordinator or the number of processes); SPECFORMER_INIT_TIMEOUT sets the wait")
    return (f"{setup.describe()}: the processes did not all join within {setup.timeout_s} s "
            "(SPECFORMER_INIT_TIMEOUT sets the wait; SPECFORMER_DISTRIBUTED=off runs a single process)")


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, env: Mapping[str, str] | None = None) -> DistributedSetup:
    """Join the other processes of a multi-process run (jax.distributed.initialize) when the environment or the
    arguments ask for it; do nothing for a single process. Call before anything touches a JAX device.

    Waits at most SPECFORMER_INIT_TIMEOUT seconds for every process to join; if one never does, this process prints
    one error line and exits with status 2 (JAX itself would abort with a core dump a little later)."""
    setup = distributed_setup(os.environ if env is None else env, coordinator, num_processes, process_id)
    if setup.how == "none" or jax.distributed.is_initialized():
        return setup
    joined = threading.Event()
    watchdog = threading.Timer(setup.timeout_s, lambda: joined.is_set() or _exit_with(_timeout_message(setup)))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**setup.jax_kwargs())
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError/ValueError/XlaRuntimeError; all are setup errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SpecformerError(f"could not start the multi-process run ({setup.describe()}): {first}") from None
    finally:
        joined.set()
        watchdog.cancel()
    return setup


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
