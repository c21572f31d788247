"""The jitted decode loops and the train step lower for TPU (jax.export), so the TPU path is checked without a TPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import export

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.autoregressive import ar_generate
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.decoding.speculative import spec_generate, specformer_drafts
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.target import Target
from specformer_jax.training.train_config import TrainConfig

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)
DRAFTER = DrafterConfig(num_slots=3)
B, TP, N = 2, 32, 8


def target_params():
    return jax.eval_shape(lambda: Target(CFG).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32),
                                                   KVCache.zeros(2, 1, 1, 2, 16))["params"])


def lowered_for_tpu(fn, *args):
    exp = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exp.platforms == ("tpu",)
    return exp.mlir_module()


def spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, 20, 0.9)])
def test_ar_loop_exports_for_tpu(sampling):
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), B))
    text = lowered_for_tpu(
        lambda p, t, l, m, k: ar_generate(p, t, l, m, k, cfg=CFG, sampling=sampling, eos_ids=(2,), max_new_tokens=N),
        target_params(), spec((B, TP)), spec((B,)), spec((B,)), keys)
    assert "stablehlo.while" in text


def spec_loop(cfg, sampling):
    hooks = DRAFTER.resolved_hooks(cfg)
    return lambda p, d, t, l, m, k: spec_generate(p, d, t, l, m, k, cfg=cfg, hooks=hooks, num_slots=3, eos_ids=(2,),
                                                  draft_fn=specformer_drafts(cfg, DRAFTER, 3), sampling=sampling,
                                                  max_new_tokens=N)


def spec_loop_args():
    dparams = jax.eval_shape(lambda: init_drafter(CFG, DRAFTER, jax.random.key(0)))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), B))
    return target_params(), dparams, spec((B, TP)), spec((B,)), spec((B,)), keys


def test_speculative_loop_exports_for_tpu():
    for sampling in (SamplingConfig(), SamplingConfig(0.8, 10, 0.95)):
        text = lowered_for_tpu(spec_loop(CFG, sampling), *spec_loop_args())
        assert "stablehlo.while" in text


def test_speculative_loop_on_pallas_kernels_lowers_for_tpu_and_cuda():
    """The whole verify loop with the Mosaic kernel in every attention layer (target and drafter context layer)
    exports for TPU; with the Triton kernel it lowers for CUDA."""
    text = lowered_for_tpu(spec_loop(dataclasses.replace(CFG, attention_impl="pallas_tpu"), SamplingConfig()),
                           *spec_loop_args())
    assert text.count("tpu_custom_call") >= 2  # the prefill and verify shapes (each kernel function is shared)
    assert "context_attn/jit(ragged_attention_tpu_fwd)" in text  # the drafter's context layer runs on it too
    gpu = dataclasses.replace(CFG, attention_impl="pallas_gpu")
    lowered = jax.jit(spec_loop(gpu, SamplingConfig())).trace(*spec_loop_args()).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.parametrize("attention_impl", ["auto", "pallas_tpu"])
def test_train_step_exports_for_tpu(attention_impl):
    """With pallas_tpu the frozen target and the drafter's context layer run the Mosaic kernel; the drafter's
    gradient goes through the kernel's fused backward."""
    from specformer_jax.checkpoints.loader import LoadedTarget
    from specformer_jax.parallel import make_mesh
    from specformer_jax.training.trainer import TrainState, make_optimizer, make_steps

    cfg = TrainConfig(num_slots=3, seq_len=32, batch_size=B, chunk_positions=32)
    tx = make_optimizer(cfg)
    target = LoadedTarget(dataclasses.replace(CFG, attention_impl=attention_impl), target_params(), None, (2,),
                          "abstract")
    train_step, _ = make_steps(target, cfg, tx, make_mesh("data=-1"))
    dparams = jax.eval_shape(lambda: init_drafter(CFG, cfg.drafter(), jax.random.key(0)))
    state = jax.eval_shape(lambda p: TrainState(jnp.int32(0), p, tx.init(p)), dparams)
    batch = {"tokens": spec((B, 32)), "label_mask": spec((B, 32))}
    exp = export.export(train_step, platforms=["tpu"])(state, target.params, batch)
    assert exp.platforms == ("tpu",)
    assert ("tpu_custom_call" in exp.mlir_module()) == (attention_impl == "pallas_tpu")
