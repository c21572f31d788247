"""Joining the other processes of a multi-process run (hosts of a TPU pod, tasks of a SLURM job, processes started by
launch/local.sh). jax.distributed must be initialized before anything touches a JAX device; after that, jax.devices()
lists the devices of every process and a Mesh built from it (specformer_jax.parallel) spans them all."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Mapping

import jax

from specformer_jax.checks import NON_NEGATIVE_INT, POSITIVE_INT, Kind, is_int
from specformer_jax.errors import SpecformerError

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


def _int_setting(name: str, value, kind: Kind) -> int | None:
    """A setting from the environment (text) or from the command line (already an int); None when unset."""
    if value is None or value == "":
        return None
    return kind.check(name, value) if is_int(value) else kind.parse(str(value), name)


def _check_coordinator(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecformerError(f"coordinator must be HOST:PORT (e.g. 10.0.0.1:8476), got {address!r}")
    return address


def _explicit_setup(coordinator, num_processes, process_id, timeout_s: int) -> DistributedSetup:
    count = _int_setting("number of processes (SPECFORMER_NUM_PROCESSES / --num-processes)", num_processes,
                         POSITIVE_INT)
    rank = _int_setting("process id (SPECFORMER_PROCESS_ID / --process-id)", process_id, NON_NEGATIVE_INT)
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
    timeout_s = (_int_setting("SPECFORMER_INIT_TIMEOUT", env.get("SPECFORMER_INIT_TIMEOUT"), POSITIVE_INT)
                 or INIT_TIMEOUT_S)
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
    return DistributedSetup(how or "none", timeout_s=timeout_s)


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
    except Exception as e:  # JAX raises RuntimeError, ValueError or XlaRuntimeError: all are setup errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise SpecformerError(f"could not start the multi-process run ({setup.describe()}): {first}") from None
    finally:
        joined.set()
        watchdog.cancel()
    return setup
