"""Sharded training and decoding on 8 fake CPU devices equal the single-device results, and both export for TPU on
the 8-device mesh (subprocesses: the device count is fixed when JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specformer_jax.errors import SpecformerError

HERE = Path(__file__).resolve().parent


def run_with_8_devices(script: str, *args: str) -> dict:
    """The script's JSON output (the Python API it uses keeps no decoding records)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "multidevice" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow  # about a minute on 2 cores (8 fake devices, several layouts)
def test_sharded_train_step_equals_single_device():
    layouts = ["data=1", "data=8", "fsdp=8", "tensor=8", "data=2,fsdp=2,tensor=2"]
    out = run_with_8_devices("train_layouts.py", *layouts)
    ref = out["data=1"]
    assert out["export"]["platforms"] == ["tpu"] and out["export"]["nr_devices"] == 8
    assert out["export"]["sharding_annotations"] > 0
    for layout in layouts[1:]:
        got = out[layout]
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=2e-5, err_msg=layout)
        for a, b in zip(got["params"], ref["params"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=layout)
    assert out["data=8"]["sharded_params"] == 0  # pure data parallel: replicated parameters
    for layout in ("fsdp=8", "tensor=8", "data=2,fsdp=2,tensor=2"):  # parameters and Adam moments really split
        sharded = out[layout]["sharded_params"]
        assert sharded > 0 and out[layout]["sharded_opt_state"] >= 2 * sharded


def test_mesh_specs():
    from specformer_jax.parallel import parse_mesh

    assert parse_mesh(None) == {"data": 1, "fsdp": 1, "tensor": 1}  # this process sees one CPU device
    assert parse_mesh("tensor=1") == {"data": 1, "fsdp": 1, "tensor": 1}
    for bad, msg in [("model=2", "axis=size"), ("data=x", "integer"), ("data=-1,fsdp=-1", "at most one"),
                     ("data=4", "needs 4 devices")]:
        with pytest.raises(SpecformerError, match=msg):
            parse_mesh(bad)


@pytest.mark.slow  # about 50 s on 2 cores
def test_sharded_decoding_gives_the_unsharded_tokens():
    layouts = ["data=1", "data=8", "tensor=8", "data=2,tensor=4"]
    out = run_with_8_devices("decode_layouts.py", *layouts)
    ref = out["data=1"]
    assert out["export"]["platforms"] == ["tpu"] and out["export"]["nr_devices"] == 8
    assert out["export"]["sharding_annotations"] > 0
    assert ref["spec"] == ref["ar"]  # lossless on one device
    for layout in layouts[1:]:
        assert out[layout]["ar"] == ref["ar"], layout
        assert out[layout]["spec"] == ref["ar"], layout


def test_every_weight_declares_its_logical_axes():
    """Each weight of every target layout and every drafter variant carries logical axes of its own rank (declared
    beside it, modeling/layers.py), so a new weight cannot be replicated silently; one without is an error."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from specformer_jax.config import DrafterConfig, TargetConfig
    from specformer_jax.modeling.drafter import drafter_axes, drafter_shapes
    from specformer_jax.modeling.layers import logical_axes
    from specformer_jax.modeling.target import target_axes, target_shapes

    base = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    targets = [dataclasses.replace(base, **kw) for kw in (
        {}, {"qkv_bias": True, "tie_embeddings": True}, {"qk_norm": True}, {"unroll_layers": True},
        {"unroll_layers": True, "fuse_projections": True, "qkv_bias": True})]
    drafters = [DrafterConfig(num_slots=3), DrafterConfig(slot_attention="causal", intermediate_size=16),
                DrafterConfig(next_token_input=True, context_token_input=True, draft_vocab_size=20)]
    pairs = [(target_axes(t), target_shapes(t)) for t in targets]
    pairs += [(drafter_axes(base, d), drafter_shapes(base, d)) for d in drafters]
    for axes, shapes in pairs:
        ranks = jax.tree.map(lambda spec, shape: len(spec) == len(shape.shape), axes, shapes)
        assert all(jax.tree.leaves(ranks))
    used = {a for axes, _ in pairs for spec in jax.tree.leaves(axes) for a in spec if a}
    assert used == {"embed", "heads", "kv_heads", "mlp", "vocab"}

    class Undeclared(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="proj")(x)

    boxed = jax.eval_shape(Undeclared().init, jax.random.key(0), jnp.zeros((1, 3)))["params"]
    with pytest.raises(ValueError, match=r"weight \['proj'\]\['(bias|kernel)'\] declares no logical axes"):
        logical_axes(boxed)

