"""Run by launch/local.sh (tests/test_launch.py): joins the other processes with initialize_distributed, builds a mesh
over every process's devices and checks the host<->mesh helpers of specformer_jax.parallel. Prints one JSON line."""

from __future__ import annotations

import json

from specformer_jax.distributed import initialize_distributed

setup = initialize_distributed()  # before anything touches a device

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

from specformer_jax.parallel import make_mesh, put_global, put_process_batch, replicated, to_host  # noqa: E402


def main() -> dict:
    rank, count = jax.process_index(), jax.process_count()
    mesh = make_mesh("data=-1")
    rows = 2 * jax.local_device_count()
    local = {"x": np.full((rows, 3), rank + 1, np.int32)}  # this process's share of the batch
    batch = put_process_batch(local, mesh)
    total = jax.jit(lambda b: jnp.sum(b["x"]), out_shardings=replicated(mesh))(batch)
    weights = np.arange(jax.device_count() * 2 * 5, dtype=np.float32).reshape(-1, 5)  # the same on every process
    split = put_global(weights, NamedSharding(mesh, P("data", None)))
    return {
        "how": setup.how,
        "process_index": rank,
        "process_count": count,
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "global_batch_shape": list(batch["x"].shape),
        "batch_sum": int(total),
        "gathered_equal": bool(np.array_equal(to_host(split), weights)),
        "split_is_sharded": not split.sharding.is_fully_replicated,
    }


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
