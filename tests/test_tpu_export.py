"""The decoding engine's jitted chunk and refill and the train step lower for TPU (jax.export), so the TPU path is
checked without a TPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine.chunk import run_chunk
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.pool import empty_pool, insert
from specformer_jax.modeling.drafter import drafter_shapes
from specformer_jax.modeling.target import target_shapes
from specformer_jax.training.train_config import TrainConfig

CFG = TargetConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16)
DRAFTER = DrafterConfig(num_slots=3)
B, TP, N = 2, 32, 8


def target_params():
    return target_shapes(CFG)


def lowered_for_tpu(fn, *args):
    exp = export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert exp.platforms == ("tpu",)
    return exp.mlir_module()


def spec(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def engine(cfg, sampling, speculative=True, drafter=DRAFTER):
    """The engine's chunk and refill as functions of (params, draft source, pool[, block]), with their abstract
    arguments."""
    plan = DecodePlan(cfg, (2,), sampling, N, 3 if speculative else 0)
    source = SpecformerDrafts(drafter, drafter_shapes(cfg, drafter)) if speculative else None
    if speculative:  # bound to the target, as the engine binds it once per call
        source = jax.eval_shape(lambda d, p: d.bind(plan, p), source, target_params())
    pool = jax.eval_shape(lambda: empty_pool(plan, B, 64, source))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), B))
    chunk = (lambda p, d, s: run_chunk(plan, 4, plan.draft_len, p, d, Verify(), s)), (target_params(), source, pool)
    refill = (lambda p, d, s, *block: insert(plan, p, d, s, *block),
              (target_params(), source, pool, spec((B, TP)), spec((B,)), spec((B,)), spec((B,)), keys))
    return chunk, refill


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, 20, 0.9)])
def test_engine_exports_for_tpu(sampling, speculative):
    (chunk, chunk_args), (refill, refill_args) = engine(CFG, sampling, speculative)
    text = lowered_for_tpu(chunk, *chunk_args)
    assert "stablehlo.while" in text  # the chunk's rounds
    assert "stablehlo.case" not in text and "stablehlo.if" not in text  # no branch on the data: no host round trip
    lowered_for_tpu(refill, *refill_args)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, 20, 0.9)])
def test_a_draft_vocabulary_exports_for_tpu(sampling):
    """Decoding and the train step with a draft vocabulary: the gathered head, the mapped drafts, q scattered back."""
    from specformer_jax.modeling.loaded import LoadedTarget
    from specformer_jax.parallel import make_mesh
    from specformer_jax.training.trainer import TrainState, make_optimizer, make_steps

    (chunk, chunk_args), (refill, refill_args) = engine(CFG, sampling, drafter=DrafterConfig(3, draft_vocab_size=40))
    assert "stablehlo.case" not in lowered_for_tpu(chunk, *chunk_args)
    lowered_for_tpu(refill, *refill_args)
    cfg = TrainConfig(drafter=DrafterConfig(num_slots=3, draft_vocab_size=40), seq_len=32, batch_size=B,
                      chunk_positions=32)
    tx = make_optimizer(cfg)
    target = LoadedTarget(CFG, target_params(), None, (2,), "abstract")
    train_step, _ = make_steps(target, cfg, tx, make_mesh("data=-1"), np.arange(0, 200, 5, dtype=np.int32))
    state = jax.eval_shape(lambda p: TrainState(jnp.int32(0), p, tx.init(p)), drafter_shapes(CFG, cfg.drafter).weights)
    exp = export.export(train_step, platforms=["tpu"])(state, target.params, {"tokens": spec((B, 32)),
                                                                               "label_mask": spec((B, 32))})
    assert exp.platforms == ("tpu",)


def test_engine_on_pallas_kernels_lowers_for_tpu_and_cuda():
    """The chunk with the Mosaic kernel in every attention layer (target and drafter context layer) exports for TPU;
    with the Triton kernel it lowers for CUDA."""
    (chunk, args), (refill, refill_args) = engine(dataclasses.replace(CFG, attention_impl="pallas_tpu"),
                                                  SamplingConfig())
    text = lowered_for_tpu(chunk, *args)
    assert "tpu_custom_call" in text
    assert "context_attn/jit(ragged_attention_tpu_fwd)" in text  # the drafter's context layer runs on it too
    assert "tpu_custom_call" in lowered_for_tpu(refill, *refill_args)  # the prefill too
    (chunk, args), _ = engine(dataclasses.replace(CFG, attention_impl="pallas_gpu"), SamplingConfig())
    assert "triton" in jax.jit(chunk).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("attention_impl", ["auto", "pallas_tpu"])
def test_train_step_exports_for_tpu(attention_impl):
    """With pallas_tpu the frozen target and the drafter's context layer run the Mosaic kernel; the drafter's
    gradient goes through the kernel's fused backward."""
    from specformer_jax.modeling.loaded import LoadedTarget
    from specformer_jax.parallel import make_mesh
    from specformer_jax.training.trainer import TrainState, make_optimizer, make_steps

    cfg = TrainConfig(drafter=DrafterConfig(num_slots=3), seq_len=32, batch_size=B, chunk_positions=32)
    tx = make_optimizer(cfg)
    target = LoadedTarget(dataclasses.replace(CFG, attention_impl=attention_impl), target_params(), None, (2,),
                          "abstract")
    train_step, _ = make_steps(target, cfg, tx, make_mesh("data=-1"))
    state = jax.eval_shape(lambda p: TrainState(jnp.int32(0), p, tx.init(p)), drafter_shapes(CFG, cfg.drafter).weights)
    batch = {"tokens": spec((B, 32)), "label_mask": spec((B, 32))}
    exp = export.export(train_step, platforms=["tpu"])(state, target.params, batch)
    assert exp.platforms == ("tpu",)
    assert ("tpu_custom_call" in exp.mlir_module()) == (attention_impl == "pallas_tpu")
