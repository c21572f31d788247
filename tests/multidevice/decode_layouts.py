"""Run under 8 fake CPU devices (tests/test_sharding.py): greedy plain and speculative decoding of a ragged batch on
several meshes; prints the tokens per layout as JSON."""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp

from specformer_jax.checkpoints.drafter_io import LoadedDrafter
from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.chunk import run_chunk
from specformer_jax.decoding.plan import DecodePlan
from specformer_jax.decoding.pool import empty_pool
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.target import Target
from specformer_jax.parallel import decode_state_shardings, make_mesh, param_shardings

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=16)
PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72], [11, 12], [60],
           [100, 101, 102, 103, 104], [7, 7, 7, 8, 8, 8, 9, 9]]


def main(layouts):
    assert jax.device_count() == 8
    params = Target(CFG).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                              KVCache.zeros(2, 1, 1, CFG.num_kv_heads, CFG.head_dim))["params"]
    model = LoadedTarget(CFG, params, None, (), "random")
    dcfg = DrafterConfig(num_slots=3)
    drafter = LoadedDrafter(dcfg, init_drafter(CFG, dcfg, jax.random.key(1)), {})
    out = {}
    for layout in layouts:
        mesh = make_mesh(layout)
        ar = generate(model, PROMPTS, max_new_tokens=16, batch_size=8, mesh=mesh)
        spec = generate(model, PROMPTS, max_new_tokens=16, batch_size=8, mesh=mesh, drafter=drafter)
        out[layout] = {"ar": ar.token_ids, "spec": spec.token_ids, "rounds": spec.stats["rounds"]}
    # the sharded chunk of speculative rounds exports for TPU on the 8-device mesh
    mesh = make_mesh("data=2,tensor=4")
    plan = DecodePlan(CFG, (2,), SamplingConfig(), 16, dcfg, 3, 4)
    pool = jax.eval_shape(lambda: empty_pool(plan, 8, 64))
    fn = jax.jit(functools.partial(run_chunk, plan), in_shardings=(
        param_shardings(params, mesh), param_shardings(drafter.params, mesh), decode_state_shardings(pool, mesh)))
    exp = jax.export.export(fn, platforms=["tpu"])(jax.eval_shape(lambda: params),
                                                   jax.eval_shape(lambda: drafter.params), pool)
    out["export"] = {"platforms": list(exp.platforms), "nr_devices": exp.nr_devices,
                     "sharding_annotations": exp.mlir_module().count("sdy.sharding")}  # Shardy: JAX 0.10's default
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
