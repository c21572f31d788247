"""XLA's CPU matmuls and attention against the CPU kernels (pallas_kernels/cpu.py) at the shapes of decoding with the
default model: the 30 layers' products (q/k/v, o, gate/up, down; 425 MB of float32 weights) and the LM head
(49,152 x 576, 113 MB) for M = 1 .. 40 rows, and attention over the 30 layers' caches for 1 and 5 new tokens, side by
side in one process, each figure the median of interleaved calls.

    .venv/bin/python benchmarks/cpu_kernels.py --out benchmarks/results/cpu_kernels_cpu.json

Rows stand for a pool's tokens in one step: M = 1 is a plain step at batch 1, M = 5 a round with four drafts, M = 8 a
plain step at batch 8, M = 40 a round with four drafts at batch 8. Weights are random (cost does not depend on them).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import cpu, ragged_attention_reference
from specformer_jax.files import cache_dir, write_json

D, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(D, 960), (D, D), (D, 2 * INTERMEDIATE), (INTERMEDIATE, D)]  # q/k/v fused, o, gate/up fused, down


def layers(matmul):
    def run(x, weights):
        for qkv, o, gate_up, down in weights:
            a = matmul(x, qkv)
            x = x + matmul(a[..., :D], o)
            g = matmul(x, gate_up)
            x = x + matmul(jax.nn.silu(g[..., :INTERMEDIATE]) * g[..., INTERMEDIATE:], down)
        return x
    return run


def attention(kernel: bool, lengths):
    def run(q, k, v):
        for layer in range(LAYERS):
            q = (cpu.cached_attention(q, k, v, lengths, layer) if kernel
                 else ragged_attention_reference(q, k[layer], v[layer], lengths))
        return q
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", default="1,2,5,8,16,40")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=72, help="cached tokens a row in the attention chain")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    failure = cpu.build_cpu_kernels(cache_dir() / "kernels")
    if failure:
        raise SystemExit(failure)
    drawn = iter(range(1 << 30))  # a fresh key for every array
    normal = lambda shape: jax.random.normal(jax.random.fold_in(jax.random.key(0), next(drawn)), shape) * 0.02
    weights = [[normal(s) for s in SHAPES] for _ in range(LAYERS)]
    panels = [[cpu.pack_columns(w) for w in layer] for layer in weights]
    head = normal((VOCAB, D))  # a tied embedding; the kernels read it as the panels of its transpose
    head_panels = cpu.pack_columns(head.T)
    items = {}
    for m in map(int, args.rows.split(",")):
        x = normal((m, D))
        items[f"layers/xla/{m}"] = (jax.jit(layers(lambda x, w: x @ w)), (x, weights))
        items[f"layers/kernels/{m}"] = (jax.jit(layers(lambda x, p: cpu.packed_matmul(x, p, p.shape[0] * 32))),
                                        (x, panels))
        items[f"lm_head/xla/{m}"] = (jax.jit(lambda x, e: x @ e.T), (x, head))
        items[f"lm_head/kernels/{m}"] = (jax.jit(lambda x, p: cpu.packed_matmul(x, p, VOCAB)), (x, head_panels))
    cache = (LAYERS, 1, 3, args.context + 8, 64)
    k, v, lengths = normal(cache), normal(cache), jnp.full((1,), args.context, jnp.int32)
    for q_len in (1, 5):
        q = normal((1, q_len, 9, 64))
        for name, kernel in (("xla", False), ("kernels", True)):
            items[f"attention/{name}/{q_len}"] = (jax.jit(attention(kernel, lengths)), (q, k, v))
    compiled = {name: fn.lower(*a).compile() for name, (fn, a) in items.items()}
    times = {name: [] for name in items}
    for i in range(args.repeats + 1):  # interleaved: a slow spell of the machine hits every item
        for name, (_, a) in items.items():
            t = time.perf_counter()
            jax.block_until_ready(compiled[name](*a))
            if i:
                times[name].append(time.perf_counter() - t)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    doc = {"command": "python " + " ".join(sys.argv), "device": jax.devices()[0].device_kind,
           "cpu_count": os.cpu_count(), "versions": {"python": platform.python_version(), "jax": jax.__version__},
           "repeats": args.repeats, "context": args.context, "median_ms": ms}
    write_json(args.out, doc)
    for part in ("layers", "lm_head", "attention"):
        names = sorted({n.rsplit("/", 1)[1] for n in ms if n.startswith(part)}, key=int)
        for impl in ("xla", "kernels"):
            cells = " ".join(f"{n}:{ms[f'{part}/{impl}/{n}']:.2f}" for n in names)
            print(f"{part:9s} {impl:7s} {cells}", file=sys.stderr)


if __name__ == "__main__":
    main()
