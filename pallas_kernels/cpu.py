"""Kernels for decoding on CPUs: C++ (cpu.cc) that XLA calls through its FFI, with jnp references beside them.

Decoding feeds a few rows through every weight matrix and against every row's KV cache once per step. XLA's CPU
backend runs a one-row product at memory speed but, for 2-8 rows (a speculative round's k + 1 tokens), repacks the
whole weight matrix on every call; its attention copies each layer's cache out of the stack and computes over every
cache position. The kernels read each weight, and each row's valid cache, once:

  packed_matmul(x, panels, n)  x [..., K] @ W [K, n], W held as column panels [P, K, PANEL] (`pack_columns`,
                               done once when a model takes its decoding layout), float32 or bfloat16
  cached_attention(...)        new query tokens against one layer of a stacked KV cache (the dispatcher in
                               __init__.py, `ragged_attention`, calls it on CPUs)

The kernels are compiled from source on first use with the machine's C++ compiler (`build_cpu_kernels`), for this
CPU, into a directory the caller names, and registered with XLA; without a compiler (or off a CPU) the products
run as the jnp references. Both are differentiable (the backward pass runs in XLA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.reference import ragged_attention_reference

PANEL = 32  # columns per panel (kPanel in cpu.cc)
SOURCE = Path(__file__).with_name("cpu.cc")
# each kernel registered with XLA under the name of its handler symbol in cpu.cc
_TARGETS = {"packed": "SpecformerPackedMatmul", "packed_bf16": "SpecformerPackedMatmulBf16",
            "attention": "SpecformerCachedAttention"}
_state: dict = {}  # "library": the loaded kernels once registered; "failure": why they could not be built
# the compiler's target flags, tried in turn: tuned for this CPU where the compiler can (the vectors and register
# tiles follow its instruction set: 16 floats with AVX-512, 8 with AVX2, 4 elsewhere), else its default
ARCH_FLAGS = (("-march=native",), ())
MARCH_VARIABLE = "SPECFORMER_CPU_MARCH"  # a compiler target to build for instead, e.g. x86-64-v3 (AVX2)


def build_target() -> str:
    """The compiler target the kernels are built for: $SPECFORMER_CPU_MARCH, else "native" (result files say so)."""
    return os.environ.get(MARCH_VARIABLE, "").strip() or "native"


def arch_flags() -> tuple[tuple[str, ...], ...]:
    """The target flags to try in turn: `-march=$SPECFORMER_CPU_MARCH` alone where it is set (a library that runs
    on older CPUs of a fleet, or this CPU's code at another vector width), else ARCH_FLAGS."""
    march = build_target()
    return ARCH_FLAGS if march == "native" else ((f"-march={march}",),)


def _feature_macros(compiler: str, flag: str) -> set[str] | None:
    """The instruction-set macros the compiler defines under `flag` (x86's `__AVX2__`, `__AVX512F__`, ...; Arm's
    `__ARM_NEON`, `__ARM_FEATURE_SVE`, ...), None where it refuses the flag."""
    done = subprocess.run([compiler, flag, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                          timeout=60)
    if done.returncode:
        return None
    names = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define ")}
    return {n for n in names if n.startswith(("__ARM_FEATURE_", "__ARM_NEON"))
            or (n.startswith("__") and n.endswith("__") and n[2:-2].isupper())}


def _check_runs_here(compiler: str, march: str) -> None:
    """Refuse a target whose instruction sets this CPU lacks (its library would die on an illegal instruction): the
    feature macros the compiler defines for it against those it defines for -march=native (where the compiler knows
    no `native`, nothing is checked)."""
    wanted, here = _feature_macros(compiler, f"-march={march}"), _feature_macros(compiler, "-march=native")
    if wanted is None:
        raise RuntimeError(f"{MARCH_VARIABLE}={march}: the compiler does not know this target")
    missing = sorted(n.strip("_") for n in wanted - here) if here is not None else []
    if missing:
        levels = " (x86-64-v2, -v3 and -v4 name the SSE4, AVX2 and AVX-512 levels)" if platform.machine() in (
            "x86_64", "AMD64") else ""
        raise RuntimeError(f"{MARCH_VARIABLE}={march} needs {', '.join(missing[:6])}, which this CPU lacks{levels}")


def panel_count(n: int) -> int:
    return -(-n // PANEL)


def pack_columns(w: jax.Array, xp=jnp) -> jax.Array:
    """[K, N] -> column panels [ceil(N / PANEL), K, PANEL], the last one padded with zero columns. xp: the array module
    to pack with (numpy, for a concrete array on the host: nothing to compile)."""
    K, N = w.shape
    P = panel_count(N)
    return xp.pad(w, ((0, 0), (0, P * PANEL - N))).reshape(K, P, PANEL).transpose(1, 0, 2)


def unpack_columns(panels: jax.Array, n: int) -> jax.Array:
    """`pack_columns` undone: [P, K, PANEL] -> [K, n]."""
    P, K, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(K, P * PANEL)[:, :n]


def panel_columns(panels: jax.Array, ids: jax.Array) -> jax.Array:
    """Columns `ids` (int[...]) of the matrix held as `panels`, as rows: [..., K]. Of a packed embedding (the
    transposed embedding matrix's panels), the embeddings of the tokens `ids`."""
    return panels[ids // PANEL, :, ids % PANEL]


def packed_matmul_reference(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., K] times the matrix of `panels` (its first n columns): [..., n]."""
    y = jnp.einsum("...k,pkc->...pc", x, panels, preferred_element_type=jnp.float32)
    return y.reshape(*x.shape[:-1], -1)[..., :n].astype(x.dtype)


def packed_matmul(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """`packed_matmul_reference`, by the kernel where it runs (`on_kernel`): x float32, panels float32 or bfloat16
    (read as such, summed in float32: the product of the panels widened to float32)."""
    reference = lambda x, panels: packed_matmul_reference(x, panels, n)
    usable = x.dtype == jnp.float32 and panels.dtype in (jnp.float32, jnp.bfloat16)
    return on_kernel(lambda x, panels: _packed(x, panels)[..., :n], reference, x, panels, usable=usable)


def cached_attention(q, k, v, lengths, layer, *, causal=True, sliding_window=None, scale=None, rows=None):
    """`ragged_attention_reference` of q [B, Q, H, D] against layer `layer` (an int, traced or not) of the stacked
    caches k, v [L, B', Hkv, S, D] (query row b attends to cache row rows[b], default b), which the kernel reads in
    place (`on_kernel`; float32, D a multiple of 16)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    flags = (bool(causal), int(sliding_window or 0), scale)
    reference = lambda q, k, v, lengths, layer, rows=None: ragged_attention_reference(
        q, k[layer], v[layer], lengths, causal=causal, sliding_window=sliding_window, scale=scale, rows=rows)
    usable = q.shape[-1] % 16 == 0 and all(a.dtype == jnp.float32 for a in (q, k, v))
    args = (q, k, v, lengths, jnp.asarray(layer, jnp.int32))
    if rows is None:
        return on_kernel(lambda *a: _attention(*flags, *a), reference, *args, usable=usable)
    # the flat layout: inference only, the kernel without the custom VJP
    out = on_kernel(lambda *a: _ffi_attention(*flags, *a), reference, *args, rows.astype(jnp.int32), usable=usable)
    return jax.lax.stop_gradient(out)


def on_kernel(kernel, reference, *args, usable: bool | None = None):
    """kernel(*args) where the kernels are built (`kernels_ready`) and the arrays are what the kernel takes (`usable`;
    None: every floating array float32), else reference(*args). Models call these only in their CPU decoding layout
    (TargetConfig.pack_weights)."""
    if usable is None:
        usable = all(a.dtype == jnp.float32 for a in args if jnp.issubdtype(a.dtype, jnp.floating))
    if not (usable and kernels_ready()):
        return reference(*args)
    return kernel(*args)


def kernels_ready() -> bool:
    """Whether the kernels were built and registered in this process (`build_cpu_kernels`)."""
    return "library" in _state


def build_cpu_kernels(build_dir: Path) -> str | None:
    """Compile cpu.cc for this machine into `build_dir` (once: the library is named by a hash of the source,
    compiler, jaxlib and CPU) and register its kernels with XLA. Returns None when they are ready, else one line
    saying why not (the products then run in XLA). Called again, it answers from memory."""
    if "library" in _state or "failure" in _state:
        return _state.get("failure")
    try:
        library = ctypes.cdll.LoadLibrary(str(_built_library(Path(build_dir))))
        for target in _TARGETS.values():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _state["failure"] = f"the CPU matmul kernels could not be built ({str(e).strip().splitlines()[-1][:200]})"
        return _state["failure"]
    _state["library"] = library
    return None


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX)")
    return compiler


def _built_library(build_dir: Path) -> Path:
    """The compiled library for this source, compiler, jaxlib and CPU, compiled now if it is not there yet (written
    atomically: processes building at once each rename a whole file into place)."""
    compiler, flags = _compiler(), arch_flags()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, version, jax.ffi.include_dir(), jax.__version__,
                                    platform.machine(), _cpu_features(), repr(flags)]).encode()).hexdigest()[:16]
    out = build_dir / f"cpu-{key}.so"
    if out.exists():
        return out
    if build_target() != "native":  # the key holds this CPU's features: a library found was checked when built
        _check_runs_here(compiler, build_target())
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        part = Path(tmp) / out.name
        base = [compiler, "-O3", "-std=gnu++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
                str(SOURCE), "-o", str(part)]
        for target in flags:
            done = subprocess.run(base[:1] + list(target) + base[1:], capture_output=True, text=True, timeout=600)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(done.stderr or f"{compiler} failed")
        os.replace(part, out)
    return out


def _cpu_features() -> str:
    """The CPU's feature flags (a library built with -march=native runs only where they are the same)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


@jax.custom_vjp
def _packed(x, panels):
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (panels.shape[0] * PANEL,), jnp.float32)
    return jax.ffi.ffi_call(_TARGETS["packed_bf16" if panels.dtype == jnp.bfloat16 else "packed"], out)(x, panels)


def _packed_fwd(x, panels):
    return _packed(x, panels), (x, panels)


def _packed_bwd(res, dy):
    x, panels = res
    dy = dy.reshape(*dy.shape[:-1], panels.shape[0], PANEL)
    return (jnp.einsum("...pc,pkc->...k", dy, panels),
            jnp.einsum("...k,...pc->pkc", x, dy).astype(panels.dtype))


_packed.defvjp(_packed_fwd, _packed_bwd)


def _ffi_attention(causal, window, scale, q, k, v, lengths, layer, rows):
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(_TARGETS["attention"], out)(q, k, v, lengths.astype(jnp.int32), layer, rows,
                                                          causal=causal, window=window, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(causal, window, scale, q, k, v, lengths, layer):
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)  # query row b reads cache row b
    return _ffi_attention(causal, window, scale, q, k, v, lengths, layer, rows)


def _attention_fwd(causal, window, scale, q, k, v, lengths, layer):
    return _attention(causal, window, scale, q, k, v, lengths, layer), (q, k, v, lengths, layer)


def _attention_bwd(causal, window, scale, res, dy):
    """The reference's gradient (training through a model that decoded in this process), scattered into the stack;
    entries past the lengths, never read, are zeroed first (they may hold NaN, which the reference's gradient would
    spread)."""
    q, k, v, lengths, layer = res
    reference = lambda q, kl, vl: ragged_attention_reference(q, kl, vl, lengths, causal=causal,
                                                             sliding_window=window or None, scale=scale)
    valid = (jnp.arange(k.shape[3]) < lengths[:, None])[:, None, :, None]
    dq, dk, dv = jax.vjp(reference, q, jnp.where(valid, k[layer], 0), jnp.where(valid, v[layer], 0))[1](dy)
    return dq, jnp.zeros_like(k).at[layer].set(dk), jnp.zeros_like(v).at[layer].set(dv), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
