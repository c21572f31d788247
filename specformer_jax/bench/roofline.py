"""Roofline estimates of a plain decoding step and a speculative round, from model facts and device limits.

A step is bounded by reading its bytes (weights once per step, plus every row's KV cache) at the memory bandwidth,
or by its FLOPs at the peak matmul rate, whichever takes longer:

    t = max(bytes / bandwidth, flops / peak)

Plain step at batch B and context c:  bytes = W + B*c*kv,        flops = B * f(c)
Speculative round with k drafts:      bytes = W + Wd + B*c*kv,   flops = B * ((k+1) * (f(c) + fd_ctx) + fd_slots(k))
(W, Wd: target and drafter weight bytes; kv: KV bytes per cached token; f(c): target FLOPs per token at context c;
fd: drafter FLOPs.) A round emits `mean_accepted_length` tokens per row, a step 1, so the estimated speedup is
AL * t_step / t_round. The estimate ignores launch overheads and the drafter's own KV reads (one layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specformer_jax.config import DrafterConfig, TargetConfig

# Published per-chip limits: HBM bandwidth (GB/s), dense bf16 matmul peak and float32 matmul peak (TFLOP/s). A
# float32 model decodes at full precision (DecodePlan.precision in decoding/runner.py): on GPUs the FP32 units, not
# TF32; on TPUs XLA's six bf16 passes, so a sixth of the bf16 peak.
DEVICE_SPECS = {
    "NVIDIA H100 80GB HBM3": (3350.0, 989.0, 67.0),
    "NVIDIA H100": (3350.0, 989.0, 67.0),
    "NVIDIA H200": (4800.0, 989.0, 67.0),
    "NVIDIA A100-SXM4-80GB": (2039.0, 312.0, 19.5),
    "NVIDIA A100-SXM4-40GB": (1555.0, 312.0, 19.5),
    "TPU v4": (1200.0, 275.0, 275.0 / 6),
    "TPU v5 lite": (819.0, 197.0, 197.0 / 6),
    "TPU v5e": (819.0, 197.0, 197.0 / 6),
    "TPU v5p": (2765.0, 459.0, 459.0 / 6),
    "TPU v6 lite": (1640.0, 918.0, 918.0 / 6),
    "TPU v6e": (1640.0, 918.0, 918.0 / 6),
}


def kv_bytes_per_token(cfg: TargetConfig) -> int:
    """Bytes one cached position takes in a row's KV cache: keys and values of every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def model_facts(cfg: TargetConfig, drafter: DrafterConfig | None, target_params, drafter_params=None) -> dict:
    """Bytes and FLOPs that the roofline needs (recorded in bench results, so reports need no model)."""
    item = jnp.dtype(cfg.dtype).itemsize
    count = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
    d, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate_size  # attention projections + SwiGLU
    facts = {
        "target_weight_bytes": count(target_params) * item,
        "kv_bytes_per_token": kv_bytes_per_token(cfg),
        "target_matmul_flops_per_token": 2 * (L * layer + V * d),
        "attention_flops_per_token_per_context": 4 * L * q,  # QK^T and PV against each cached token
    }
    if drafter is not None:
        K, ffn = drafter.num_slots, drafter.intermediate_size or cfg.intermediate_size
        facts.update({
            "drafter_weight_bytes": count(drafter_params.weights) * item if drafter_params is not None else 0,
            "drafter_context_flops_per_token": 2 * (len(drafter.resolved_hooks(cfg)) * d * d + d * (q + 2 * kv)
                                                    + q * d),
            "drafter_attention_flops_per_token_per_context": 4 * q,
            # one drafting position: expand to K slots, slot attention over all K, then per kept slot SwiGLU + LM head
            "drafter_slot_flops_fixed": 2 * (d * K * d + K * (d * (q + 2 * kv) + q * d)),
            "drafter_slot_flops_per_slot": 2 * (3 * d * ffn + (drafter.draft_vocab_size or V) * d),
        })
    return facts


def step_seconds(facts: dict, batch: int, context: float, bandwidth: float, peak: float) -> float:
    """Plain decoding step (bandwidth in bytes/s, peak in FLOP/s)."""
    flops = batch * (facts["target_matmul_flops_per_token"] + context * facts["attention_flops_per_token_per_context"])
    bytes_ = facts["target_weight_bytes"] + batch * context * facts["kv_bytes_per_token"]
    return max(bytes_ / bandwidth, flops / peak)


def round_seconds(facts: dict, batch: int, context: float, k: int, bandwidth: float, peak: float) -> float:
    """Speculative round with k drafts: target + drafter context layer over k + 1 tokens, k slots at one position."""
    per_token = (facts["target_matmul_flops_per_token"] + facts["drafter_context_flops_per_token"]
                 + context * (facts["attention_flops_per_token_per_context"]
                              + facts["drafter_attention_flops_per_token_per_context"]))
    flops = batch * ((k + 1) * per_token + facts["drafter_slot_flops_fixed"] + k * facts["drafter_slot_flops_per_slot"])
    weights = facts["target_weight_bytes"] + facts["drafter_weight_bytes"]
    bytes_ = weights + batch * context * facts["kv_bytes_per_token"]
    return max(bytes_ / bandwidth, flops / peak)


def device_limits(result: dict) -> tuple[float, float, str]:
    """(bandwidth bytes/s, peak FLOP/s, source): published specs for known accelerators, else the bench's own
    measurement (read bandwidth and matmul rate in the model's dtype; older result files measured a copy)."""
    spec = DEVICE_SPECS.get(result.get("device", ""))
    if spec is not None:
        f32 = result.get("dtype") == "float32"
        return spec[0] * 1e9, spec[2 if f32 else 1] * 1e12, f"spec sheet, {'float32' if f32 else 'bf16'} peak"
    m = result.get("device_measured")
    if not m:
        raise ValueError("no published limits for this device and no device_measured in the result file")
    bandwidth = m.get("read_bandwidth_gb_per_s") or m["copy_bandwidth_gb_per_s"]
    return bandwidth * 1e9, m["matmul_tflop_per_s"] * 1e12, "measured"


def call_times(fn, args, repeats: int) -> list[float]:
    """Wall times of `repeats` calls of fn(*args), each waited for, after one warm-up call (compilation)."""
    import time

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return times


def _marginal_rate(fn, make_args, sizes: tuple[int, int], work, repeats: int) -> float:
    """Work per second of fn at the larger of two sizes over the smaller: (work(big) - work(small)) / (t(big) -
    t(small)), so what a call costs whatever its size (dispatch, synchronisation: ~0.1 ms on a GPU) cancels. Falls
    back to work(big) / t(big) when noise makes the larger call the faster."""
    secs = [min(call_times(fn, make_args(n), repeats)) for n in sizes]
    if secs[1] > secs[0]:
        return (work(sizes[1]) - work(sizes[0])) / (secs[1] - secs[0])
    return work(sizes[1]) / secs[1]


def measure_device(dtype: str, size_mb: int = 256, matmul_n: int | None = None, repeats: int = 5) -> dict:
    """Read bandwidth (bytes summed / time) and matmul FLOP rate in `dtype` on the default device, each from two
    sizes (`_marginal_rate`): a sum over size_mb / 4 and size_mb of float32, the matmul of n and 2n (n: 4096 on an
    accelerator, 512 on a CPU). Decoding mostly reads (weights, KV cache), and a read is what this measures: a copy
    also writes a fresh output, which on a CPU runs at a fifth of the read rate (page faults on the new buffer)."""
    n = matmul_n or (512 if jax.devices()[0].platform == "cpu" else 4096)
    elements = (size_mb * 2**20 // 16, size_mb * 2**20 // 4)  # float32
    read_bw = _marginal_rate(jax.jit(jnp.sum), lambda m: (jnp.ones((m,), jnp.float32),), elements, lambda m: 4 * m,
                            repeats)
    flops = _marginal_rate(jax.jit(lambda a, b: a @ b), lambda m: (jnp.ones((m, m), dtype),) * 2, (n, 2 * n),
                          lambda m: 2 * m**3, repeats)
    return {"read_bandwidth_gb_per_s": read_bw / 1e9, "matmul_tflop_per_s": flops / 1e12, "matmul_dtype": dtype}
