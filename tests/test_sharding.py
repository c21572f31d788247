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
