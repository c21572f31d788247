"""Roofline model facts against the real parameter trees, the roofline's regimes, and `specformer report`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import traverse_util

from specformer_jax.bench import roofline
from specformer_jax.config import DrafterConfig, TargetConfig
from specformer_jax.modeling.drafter import drafter_shapes
from specformer_jax.modeling.target import target_shapes

CFG = TargetConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32)


def target_params(cfg):
    """The parameter tree's shapes (all the roofline reads), without computing any values."""
    return target_shapes(cfg)


def drafter_params(cfg, dcfg):
    return drafter_shapes(cfg, dcfg)


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
    dflat = {k: int(np.prod(v.shape)) for k, v in traverse_util.flatten_dict(dparams.weights, sep="/").items()}
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


def bench_file(tmp_path, name, device="NVIDIA H100", facts=None, measured=None, dtype="bfloat16"):
    f = facts or roofline.model_facts(CFG, DrafterConfig(num_slots=4), target_params(CFG),
                                      drafter_params(CFG, DrafterConfig(num_slots=4)))
    doc = {"command": "specformer bench ...", "device": device, "dtype": dtype, "draft_len": 4, "num_prompts": 16,
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
    assert "(spec sheet, bf16 peak): 3,350 GB/s, 989.0 TFLOP/s" in md and "(measured): 20 GB/s, 0.2 TFLOP/s" in md
    rows = [line for line in md.splitlines() if line.startswith(("| 1 |", "| 8 |")) and line.count("|") == 13]
    assert len(rows) == 4 and all("1.50x" in r and "100%" in r for r in rows)
    assert "| 8 | 1.50x (roofline" in md  # the speedups side by side, one column per file
    doc = json.loads(cpu.read_text())
    t = roofline.step_seconds(doc["model_facts"], 8, 40.0 + 32, 20e9, 0.2e12)
    assert f"| 8 | 800 | {8 / t:,.0f} |" in md
    # a float32 model decodes at full precision: the roofline takes the float32 peak, not the bf16 one
    f32 = bench_file(tmp_path, "f32.json", dtype="float32")
    assert main(["report", str(f32), "--out", str(tmp_path / "f.md")]) == 0
    assert "(spec sheet, float32 peak): 3,350 GB/s, 67.0 TFLOP/s" in (tmp_path / "f.md").read_text()
    assert (tmp_path / "r.png").stat().st_size > 0
    # result files from before the read-bandwidth probe recorded a copy bandwidth, which is used for them
    old = bench_file(tmp_path, "old.json", device="cpu",
                     measured={"copy_bandwidth_gb_per_s": 7.0, "matmul_tflop_per_s": 0.2})
    assert main(["report", str(old), "--out", str(tmp_path / "o.md")]) == 0
    assert "(measured): 7 GB/s, 0.2 TFLOP/s" in (tmp_path / "o.md").read_text()


def test_report_errors(tmp_path, cli_error):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    assert "not valid JSON" in cli_error(["report", str(bad), "--out", str(tmp_path / "r.md")])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"results": []}))
    assert "no model facts" in cli_error(["report", str(old), "--out", str(tmp_path / "r.md")])
    assert "does not exist" in cli_error(["report", str(tmp_path / "missing.json"), "--out", str(tmp_path / "r.md")])


RESULTS = Path(__file__).resolve().parent / "data" / "results"  # copies of real result files, kept as they were
DELETE = object()


def changed(tmp_path, name, change):
    """A real bench result file (tests/data/results/) with `change` applied to its document."""
    doc = json.loads((RESULTS / name).read_text())
    change(doc)
    path = tmp_path / f"changed_{name}"
    path.write_text(json.dumps(doc))
    return path


def _set(keys, value):
    """A change that sets the field at doc[keys[0]][keys[1]]... to value, or deletes it (value DELETE)."""
    def change(doc):
        *parents, last = keys
        for k in parents:
            doc = doc[k]
        if value is DELETE:
            del doc[last]
        else:
            doc[last] = value
    return change


@pytest.mark.parametrize("name,keys,value,message", [
    ("bench_cpu_quiet.json", ["results", 0, "ar"], DELETE, '(batch 1 lacks "ar")'),
    ("bench_h100_k4.json", ["results", 1, "spec"], DELETE, '(batch 4 lacks "spec")'),
    ("bench_h100_k4.json", ["results", 2, "speedup"], DELETE, '(batch 16 lacks "speedup")'),
    ("bench_cpu_quiet.json", ["model_facts", "kv_bytes_per_token"], DELETE,
     '("model_facts" lacks "kv_bytes_per_token")'),
    ("bench_cpu_quiet.json", ["model_facts", "drafter_weight_bytes"], DELETE,
     '("model_facts" lacks "drafter_weight_bytes")'),
    ("bench_h100_k4.json", ["mean_prompt_tokens"], DELETE, '(the file lacks "mean_prompt_tokens")'),
    ("bench_cpu_quiet.json", ["results", 0, "ar", "tokens_per_second"], "fast",
     '(batch 1 "ar" has "tokens_per_second": "fast", not a non-negative finite number)'),
    ("bench_cpu_quiet.json", ["device_measured"], DELETE, '(the file lacks "device_measured")'),
    ("bench_cpu_quiet.json", ["device_measured", "read_bandwidth_gb_per_s"], 0,
     '("device_measured" has "read_bandwidth_gb_per_s": 0, not a positive finite number)'),
    ("bench_cpu_quiet.json", ["results", 1, "spec", "mean_accepted_length"], 0,
     '(batch 8 "spec" has "mean_accepted_length": 0, not a positive finite number)'),
])
def test_report_names_what_a_damaged_bench_file_lacks(tmp_path, cli_error, name, keys, value, message):
    path = changed(tmp_path, name, _set(keys, value))
    err = cli_error(["report", str(path), "--out", str(tmp_path / "r.md")])
    assert f"{path}: not a complete specformer bench result {message}" in err


def test_report_marks_a_partial_run(tmp_path):
    from specformer_jax.cli import main

    def cut_short(doc):
        doc["results"], doc["complete"] = doc["results"][:1], False

    partial = changed(tmp_path, "bench_cpu_quiet.json", cut_short)
    assert main(["report", str(partial), str(RESULTS / "bench_cpu_auto_quiet.json"), "--out", str(tmp_path / "r.md"),
                 "--plot", str(tmp_path / "r.png")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert "## cpu (float32) (partial run: 1 batch size)" in md
    assert "## cpu (float32)\n" in md  # the complete file is not marked


def test_report_errors_on_empty_results_and_bench_kernels_files(tmp_path, cli_error):
    empty = changed(tmp_path, "bench_cpu_quiet.json", _set(["results"], []))
    assert f'{empty} records no batch sizes (its "results" list is empty)' in cli_error(
        ["report", str(empty), "--out", str(tmp_path / "r.md")])
    kernels = RESULTS / "kernels_h100_cold.json"
    err = cli_error(["report", str(kernels), "--out", str(tmp_path / "r.md")])
    assert f"{kernels} is a bench-kernels result; report reads specformer bench files" in err
