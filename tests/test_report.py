"""Roofline model facts against the real parameter trees, the roofline's regimes, and `specformer report`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from specformer_jax.bench import roofline
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import KVCache
from specformer_jax.modeling.target import Target

CFG = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32)


def target_params(cfg):
    """The parameter tree's shapes (all the roofline reads), without computing any values."""
    cache = KVCache.zeros(cfg.num_layers, 1, 8, cfg.num_kv_heads, cfg.head_dim)
    return jax.eval_shape(Target(cfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32), cache)["params"]


def drafter_params(cfg, dcfg):
    return jax.eval_shape(lambda: init_drafter(cfg, dcfg, jax.random.key(1)))


@pytest.mark.parametrize("tied", [False, True])
def test_model_facts_count_the_real_parameters(tied):
    cfg = TargetConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    params = target_params(cfg)
    dcfg = DrafterConfig(num_slots=3)
    dparams = drafter_params(cfg, dcfg)
    f = roofline.model_facts(cfg, dcfg, params, dparams)
    flat = traverse_util.flatten_dict(params, sep="/")
    sizes = {k: int(np.prod(v.shape)) for k, v in flat.items()}
    assert f["target_weight_bytes"] == 4 * sum(sizes.values())
    # every matrix is used once per token (2 FLOPs per weight); the embedding table only as the tied LM head
    matrices = sum(n for k, n in sizes.items() if k.endswith("kernel")) + (sizes["embed/embedding"] if tied else 0)
    assert f["target_matmul_flops_per_token"] == 2 * matrices
    assert f["kv_bytes_per_token"] == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    dflat = {k: int(np.prod(v.shape)) for k, v in traverse_util.flatten_dict(dparams, sep="/").items()}
    assert f["drafter_weight_bytes"] == 4 * sum(dflat.values())
    context = sum(n for k, n in dflat.items() if k.startswith(("fuse/", "context_attn/")) and k.endswith("kernel"))
    assert f["drafter_context_flops_per_token"] == 2 * context


def test_roofline_regimes():
    dcfg = DrafterConfig(num_slots=4)
    f = roofline.model_facts(CFG, dcfg, target_params(CFG), drafter_params(CFG, dcfg))
    bw, peak = 1e12, 1e15
    # batch 1: memory bound, a round reads the weights once like a step: speedup ~ AL * W / (W + Wd)
    t1, r1 = roofline.step_seconds(f, 1, 100, bw, peak), roofline.round_seconds(f, 1, 100, 4, bw, peak)
    assert t1 == pytest.approx((f["target_weight_bytes"] + 100 * f["kv_bytes_per_token"]) / bw)
    assert 1.0 < r1 / t1 < 1.0 + f["drafter_weight_bytes"] / f["target_weight_bytes"] + 1e-9
    # large batch on a device with little compute: FLOP bound, a round costs more than k + 1 steps, so drafting
    # cannot pay at AL <= k + 1 (at long contexts the KV reads bound both equally instead)
    bw, peak = 1e15, 1e12
    tb, rb = roofline.step_seconds(f, 1 << 12, 10, bw, peak), roofline.round_seconds(f, 1 << 12, 10, 4, bw, peak)
    assert tb == pytest.approx((1 << 12) * (f["target_matmul_flops_per_token"]
                                            + 10 * f["attention_flops_per_token_per_context"]) / peak)
    assert rb / tb > 5.0
    tk, rk = roofline.step_seconds(f, 1 << 12, 1e5, 1e12, 1e15), roofline.round_seconds(f, 1 << 12, 1e5, 4, 1e12, 1e15)
    assert rk / tk == pytest.approx(1.0, rel=1e-3)


def bench_file(tmp_path, name, device="NVIDIA H100", facts=None, measured=None):
    f = facts or roofline.model_facts(CFG, DrafterConfig(num_slots=4), target_params(CFG),
                                      drafter_params(CFG, DrafterConfig(num_slots=4)))
    doc = {"command": "specformer bench ...", "device": device, "dtype": "bfloat16", "draft_len": 4, "num_prompts": 16,
           "max_new_tokens": 64, "mean_prompt_tokens": 40.0, "model_facts": f,
           "device_measured": measured or {"read_bandwidth_gb_per_s": 20.0, "matmul_tflop_per_s": 0.2},
           "results": [{"batch_size": b, "ar": {"tokens_per_second": 100.0 * b},
                        "spec": {"tokens_per_second": 150.0 * b, "draft_len": 4, "mean_accepted_length": 2.0},
                        "speedup": 1.5, "output_equivalence": 1.0} for b in (1, 8)]}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_report_lays_devices_side_by_side(tmp_path, capsys):
    from specformer_jax.cli import main

    gpu, cpu = bench_file(tmp_path, "gpu.json"), bench_file(tmp_path, "cpu.json", device="cpu")
    assert main(["report", str(gpu), str(cpu), "--out", str(tmp_path / "r.md"), "--plot", str(tmp_path / "r.png")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert "## NVIDIA H100 (bfloat16)" in md and "## cpu (bfloat16)" in md
    assert "3350 GB/s, 989.00 TFLOP/s" in md and "(measured): 20 GB/s, 0.20 TFLOP/s" in md
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 8 |")]
    assert len(rows) == 4 and all("1.50x" in r and "100%" in r for r in rows)
    doc = json.loads(cpu.read_text())
    t = roofline.step_seconds(doc["model_facts"], 8, 40.0 + 32, 20e9, 0.2e12)
    assert f"| 8 | 800.0 | {8 / t:.1f} |" in md
    assert (tmp_path / "r.png").stat().st_size > 0
    # result files from before the read-bandwidth probe recorded a copy bandwidth, which is used for them
    old = bench_file(tmp_path, "old.json", device="cpu", measured={"copy_bandwidth_gb_per_s": 7.0, "matmul_tflop_per_s": 0.2})
    assert main(["report", str(old), "--out", str(tmp_path / "o.md")]) == 0
    assert "(measured): 7 GB/s, 0.20 TFLOP/s" in (tmp_path / "o.md").read_text()


def test_report_errors(tmp_path, cli_error):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert "not valid JSON" in cli_error(["report", str(bad), "--out", str(tmp_path / "r.md")])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": []}))
    assert "no model facts" in cli_error(["report", str(old), "--out", str(tmp_path / "r.md")])
    assert "cannot read" in cli_error(["report", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r.md")])
