"""Run under 8 fake CPU devices (tests/test_sharding.py starts it in a subprocess): one train step of a tiny drafter
on several mesh layouts; prints loss and parameter checksums per layout as JSON."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.drafter import drafter_shapes, init_drafter
from specformer_jax.modeling.loaded import LoadedTarget
from specformer_jax.modeling.target import init_target
from specformer_jax.parallel import make_mesh
from specformer_jax.training.train_config import TrainConfig
from specformer_jax.training.trainer import TrainState, make_optimizer, make_steps, train_shardings

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=4,
                   head_dim=16)


def main(layouts):
    assert jax.device_count() == 8, jax.devices()
    params = init_target(CFG, jax.random.key(0))
    target = LoadedTarget(CFG, params, None, (2,), "random")
    cfg = TrainConfig(drafter=DrafterConfig(num_slots=3), seq_len=32, batch_size=8, chunk_positions=64, lr=1e-2,
                      steps=10)
    tx = make_optimizer(cfg)
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (8, 32)).astype(np.int32),
             "label_mask": (np.arange(32)[None, :] >= rng.integers(4, 12, (8, 1))).astype(np.int32)}
    out = {}
    for layout in layouts:
        mesh = make_mesh(layout)
        train_step, _ = make_steps(target, cfg, tx, mesh)
        state_sh, target_sh = train_shardings(target, cfg, tx, mesh)
        dparams = init_drafter(CFG, cfg.drafter, jax.random.key(1)).weights
        state = jax.device_put(TrainState(jnp.int32(0), dparams, tx.init(dparams)), state_sh)
        tparams = jax.device_put(params, target_sh)
        losses = []
        for _ in range(3):
            state, metrics = train_step(state, tparams, batch)
            losses.append(float(metrics["loss"]))
        shard_counts = sorted({len(x.sharding.device_set) for x in jax.tree.leaves(state.params)})
        out[layout] = {"losses": losses, "params": [np.asarray(x).ravel()[:64].tolist()
                                                    for x in jax.tree.leaves(state.params)],
                       "devices_per_param": shard_counts,
                       "sharded_params": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params)),
                       "sharded_opt_state": sum(not x.sharding.is_fully_replicated
                                                for x in jax.tree.leaves(state.opt_state))}
    # the sharded train step exports for TPU on the 8-device mesh
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    train_step, _ = make_steps(LoadedTarget(CFG, jax.eval_shape(lambda: params), None, (2,), "abstract"), cfg, tx,
                               mesh)
    abstract = jax.eval_shape(lambda p: TrainState(jnp.int32(0), p, tx.init(p)),
                              drafter_shapes(CFG, cfg.drafter).weights)
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    exp = jax.export.export(train_step, platforms=["tpu"])(abstract, jax.eval_shape(lambda: params), spec)
    out["export"] = {"platforms": list(exp.platforms), "nr_devices": exp.nr_devices,
                     "sharding_annotations": exp.mlir_module().count("sdy.sharding")}  # Shardy: JAX 0.10's default
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
