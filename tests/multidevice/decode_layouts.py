"""Run under 8 fake CPU devices (tests/test_sharding.py): greedy plain and speculative decoding of a ragged batch on
several meshes; prints the tokens per layout as JSON."""

from __future__ import annotations

import functools
import json
import sys

import jax

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine.chunk import run_chunk
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.pool import empty_pool
from specformer_jax.modeling.drafter import drafter_axes, init_drafter
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget
from specformer_jax.modeling.target import init_target, target_axes
from specformer_jax.parallel import decode_state_shardings, make_mesh, param_shardings

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=16)
PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72], [11, 12], [60],
           [100, 101, 102, 103, 104], [7, 7, 7, 8, 8, 8, 9, 9]]


def main(layouts):
    assert jax.device_count() == 8
    params = init_target(CFG, jax.random.key(0))
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
    plan = DecodePlan(CFG, (2,), SamplingConfig(), 16, 3)
    source = SpecformerDrafts(dcfg, drafter.params)
    pool = jax.eval_shape(lambda: empty_pool(plan, 8, 64, source))
    source_sh = SpecformerDrafts(dcfg, param_shardings(drafter.params, drafter_axes(CFG, dcfg), mesh))
    fn = jax.jit(functools.partial(run_chunk, plan, 4, plan.draft_len), in_shardings=(
        param_shardings(params, target_axes(CFG), mesh), source_sh, None, decode_state_shardings(pool, mesh)))
    exp = jax.export.export(fn, platforms=["tpu"])(jax.eval_shape(lambda: params), jax.eval_shape(lambda: source),
                                                   Verify(), pool)
    out["export"] = {"platforms": list(exp.platforms), "nr_devices": exp.nr_devices,
                     "sharding_annotations": exp.mlir_module().count("sdy.sharding")}  # Shardy: JAX 0.10's default
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
