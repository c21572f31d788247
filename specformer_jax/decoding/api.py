"""Notebook-friendly decoding API: `generate(model, prompts, ...)` -> texts, token ids and stats. The CLI uses it too."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import numbers
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specformer_jax.checkpoints.loader import LoadedTarget
from specformer_jax.checkpoints.drafter_io import LoadedDrafter, check_drafter_fits
from specformer_jax.decoding.autoregressive import ar_generate
from specformer_jax.decoding.draft_len import (auto_draft_len, check_draft_len, default_draft_len,
                                                remember_acceptance, remember_batch_rounds)
from specformer_jax.decoding.speculative import spec_generate, specformer_drafts
from specformer_jax.decoding.sampling import SamplingConfig
from specformer_jax.errors import SpecformerError, check_int, check_number, is_int
from specformer_jax.parallel import batch_sharded, make_mesh, param_shardings

Prompt = str | Sequence[int]  # text (tokenized, chat template unless chat=False) or token ids used as they are


@dataclasses.dataclass
class GenerationResult:
    texts: list[str | None]  # None when the model has no tokenizer
    token_ids: list[list[int]]  # generated ids per prompt, EOS included when it was produced
    stats: dict[str, Any]

    def to_json(self) -> dict:
        return {
            "results": [{"text": t, "token_ids": ids} for t, ids in zip(self.texts, self.token_ids)],
            "stats": self.stats,
        }


def encode_prompts(model: LoadedTarget, prompts: Sequence[Prompt], chat: bool = True) -> list[list[int]]:
    """Token ids for each prompt; text goes through the chat template unless chat=False."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise SpecformerError(f"{model.source} has no tokenizer: give prompts as token ids (input_ids)")
            tok = model.tokenizer
            if chat and tok.chat_template:
                p = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            ids = tok.encode(p, add_special_tokens=not chat)
        else:
            ids = _token_ids(i, p)
            bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
            if bad:
                raise SpecformerError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (size {model.cfg.vocab_size})")
        if not ids:
            raise SpecformerError(f"prompt {i} is empty")
        out.append(ids)
    return out


def _token_ids(i: int, prompt) -> list[int]:
    """A prompt given as token ids: a sequence (list, tuple, 1-D array) of integers."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
        return prompt.tolist()
    if isinstance(prompt, (list, tuple)) and all(map(is_int, prompt)):
        return [int(t) for t in prompt]
    raise SpecformerError(f"prompt {i} must be text or a list of integer token ids, got {prompt!r:.60}")


def _checked_prompts(prompts) -> list:
    """The prompts as a list; a single prompt passed bare (a string, or one list of ids) is refused, not split."""
    if isinstance(prompts, (str, bytes)) or (isinstance(prompts, (list, tuple)) and prompts
                                               and isinstance(prompts[0], numbers.Integral)):
        raise SpecformerError("prompts must be a list of prompts (text or token-id lists): wrap a single prompt "
                              "as [prompt]")
    try:
        return list(prompts)
    except TypeError:
        raise SpecformerError(f"prompts must be a list of prompts, got {type(prompts).__name__}") from None


def _padded_batch(chunk: list[list[int]], B: int, max_new_tokens: int):
    """Right-padded prompts int32[B, Tp] (Tp: a multiple of 32, to reuse compilations), lengths, budgets.

    Rows past the chunk are inactive padding (budget 0), so a short last chunk reuses the batch-B compilation.
    """
    Tp = -(-max(len(p) for p in chunk) // 32) * 32
    prompts = np.zeros((B, Tp), np.int32)
    lens = np.ones((B,), np.int32)
    budget = np.zeros((B,), np.int32)
    for r, p in enumerate(chunk):
        prompts[r, : len(p)] = p
        lens[r] = len(p)
        budget[r] = max_new_tokens
    return jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(budget)


class _Compiled:
    """Ahead-of-time compiled decode functions keyed by shapes and static options, so compile time is measured apart."""

    def __init__(self):
        self._cache: dict = {}

    def get(self, key, fn, *args, precision: str | None = None):
        if key in self._cache:
            return self._cache[key], 0.0
        t = time.perf_counter()
        with jax.default_matmul_precision(precision) if precision else contextlib.nullcontext():
            compiled = jax.jit(fn).lower(*args).compile()
        self._cache[key] = compiled
        return compiled, time.perf_counter() - t


_COMPILED = _Compiled()


def decode_precision(dtype: str) -> str | None:
    """float32 models decode with float32 matmuls everywhere. GPUs would otherwise round them to TF32 and TPUs to
    bfloat16 passes; a verify forward over k + 1 tokens and a one-token step are then rounded differently, near-ties
    of the greedy argmax flip, and speculative output drifts from plain output (seen on an H100: 75% of rows equal)."""
    return "highest" if dtype == "float32" else None


def generate(
    model: LoadedTarget,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    chat: bool = True,
    max_cache_len: int | None = None,
    progress: bool = False,
    drafter: LoadedDrafter | None = None,
    draft_len: int | str | None = None,
    mesh: Mesh | str | None = None,
    remember: bool = True,
) -> GenerationResult:
    """Decode every prompt (ragged lengths are fine) in batches of `batch_size`, fully on the device.

    With a drafter, decoding is speculative: greedy gives the same tokens as without it, sampling the same distribution.
    `draft_len`: drafts per round, <= the drafter's trained slots (default: all of them on an accelerator, 1 on a CPU,
    see draft_len.default_draft_len; 0: plain decoding), or
    "auto": chosen for this batch size from measured step costs and the drafter's acceptance (see draft_len.py).
    `mesh` (specformer_jax.parallel.make_mesh, or its spec such as "data=4,tensor=2"): rows sharded over its batch axes, the model by the logical-axis rules
    (tensor parallel over `tensor`); batch_size is rounded up to a multiple of the batch axes.
    `remember`: fold the measured acceptance, and the batch's plain steps per round, into the running estimates that
    "auto" uses (draft_len.py).
    """
    prompts = _checked_prompts(prompts)
    if not prompts:
        raise SpecformerError("no prompts given")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    seed = check_int("seed", seed, -2**63, 2**63 - 1)
    sampling = SamplingConfig(check_number("temperature", temperature), check_int("top_k", top_k, 0),
                              check_number("top_p", top_p))
    if drafter is not None:
        check_drafter_fits(drafter, model.cfg)
    if draft_len not in (None, "auto"):
        draft_len = check_int("draft_len", draft_len, 0)
        if drafter is None and draft_len:
            raise SpecformerError(f"draft_len={draft_len} needs a drafter (drafter=load_drafter(path, model))")
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    if mesh is not None and not {"data", "fsdp", "tensor"} <= set(getattr(mesh, "axis_names", ())):
        raise SpecformerError("mesh must have the axes data, fsdp and tensor: make it with "
                              "specformer_jax.parallel.make_mesh (or pass its spec, e.g. \"data=4,tensor=2\")")
    if draft_len == "auto" and drafter is None:
        draft_len = 0
    spec = None if draft_len == "auto" else _speculative_setup(model, drafter, draft_len)
    limit = max_cache_len or model.cfg.max_position
    ids = encode_prompts(model, prompts, chat)
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise SpecformerError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} cache positions but the cache holds {limit}"
            )
    root = jax.random.key(seed)
    row_keys_all = jax.vmap(lambda i: jax.random.fold_in(root, i))(jnp.arange(len(ids)))
    B = min(batch_size, len(ids))
    params, dparams = model.params, drafter.params if drafter is not None else None
    if mesh is not None:
        rows = mesh.shape["data"] * mesh.shape["fsdp"]
        B = -(-B // rows) * rows
        params = jax.device_put(params, param_shardings(params, mesh))
        if dparams is not None:
            dparams = jax.device_put(dparams, param_shardings(dparams, mesh))
    auto = None
    if draft_len == "auto":
        typical = -(-(sum(map(len, ids)) // len(ids) + max_new_tokens // 2) // 64) * 64  # mid-decode, rounded up
        auto = auto_draft_len(model, drafter, B, typical, sampled=sampling.temperature > 0, progress=progress)
        spec = _speculative_setup(model, drafter, auto.draft_len)
        if progress:
            guess = ", ".join(f"k={k}: {v:.2f}x" for k, v in auto.predicted_speedup.items())
            print(f"specformer: --draft-len auto chose {auto.draft_len} for batch {B} (predicted {guess})",
                  file=sys.stderr)
    tokens_out: list[list[int]] = []
    compile_s = run_s = 0.0
    steps = plain_steps = 0  # loop iterations run; the steps plain decoding needs for the same tokens
    spec_rows: dict[str, list] = {}
    for start in range(0, len(ids), B):
        chunk = ids[start : start + B]
        n = len(chunk)
        prompt_arr, lens, budget = _padded_batch(chunk, B, max_new_tokens)
        keys = row_keys_all[start : start + n]
        if n < B:  # pad the last chunk with inactive rows so it reuses the compiled function
            keys = jnp.concatenate([keys, jnp.broadcast_to(keys[:1], (B - n,))])
        if mesh is not None:
            prompt_arr, lens, budget, keys = jax.device_put((prompt_arr, lens, budget, keys), batch_sharded(mesh))
        key, fn, args = _decode_loop(model, drafter, spec, sampling, max_new_tokens, mesh, params, dparams,
                                     (prompt_arr, lens, budget, keys))
        compiled, c = _COMPILED.get(key, fn, *args, precision=decode_precision(model.cfg.dtype))
        compile_s += c
        t = time.perf_counter()
        result = jax.block_until_ready(compiled(*args))
        run_s += time.perf_counter() - t
        out, num_out = np.asarray(result["out"]), np.asarray(result["num_out"])
        tokens_out += [out[r, : num_out[r]].tolist() for r in range(n)]
        steps += int(result["steps"])
        plain_steps += max(int(num_out.max()) - 1, 0)  # the prefill emits each row's first token
        for name in ("row_rounds", "row_emitted", "accepted"):
            if name in result:
                spec_rows.setdefault(name, []).extend(np.asarray(result[name])[:n])
        if progress:
            print(f"specformer: {len(tokens_out)}/{len(ids)} prompts done", file=sys.stderr)
    num_generated = sum(len(t) for t in tokens_out)
    texts = [
        model.tokenizer.decode(t, skip_special_tokens=True) if model.tokenizer is not None else None for t in tokens_out
    ]
    stats = {
        "num_prompts": len(ids),
        "num_generated": num_generated,
        "tokens_per_second": num_generated / run_s if run_s else 0.0,
        "run_seconds": run_s,
        "compile_seconds": compile_s,
        "decode_steps": steps,
        "batch_size": B,
        "device": jax.devices()[0].device_kind,
        "dtype": model.cfg.dtype,
    }
    if drafter is not None:
        stats["draft_len"] = spec["num_slots"] if spec else 0
    if auto is not None:
        stats["draft_len_auto"] = auto.to_json()
    if spec_rows:
        stats.update(speculative_stats(spec_rows))
        stats["batch_accepted_length"] = plain_steps / max(steps, 1)
        if remember:
            sampled = sampling.temperature > 0
            remember_acceptance(model, drafter, stats["acceptance_rate_per_slot"], stats["rounds"], sampled=sampled)
            remember_batch_rounds(model, drafter, B, spec["num_slots"], plain_steps, steps, sampled=sampled)
    return GenerationResult(texts, tokens_out, stats)


def speculative_stats(rows: dict[str, list]) -> dict:
    """mean_accepted_length (tokens per target forward, bonus included), per-slot acceptance, rounds: total and per row."""
    rounds = np.asarray(rows["row_rounds"], np.int64)
    emitted = np.asarray(rows["row_emitted"], np.int64)
    accepted = np.asarray(rows["accepted"], np.int64)
    total = max(int(rounds.sum()), 1)
    return {
        "rounds": int(rounds.sum()),
        "mean_accepted_length": float(emitted.sum() / total),
        "acceptance_rate_per_slot": (accepted.sum(0) / total).tolist(),
        "per_row": {
            "rounds": rounds.tolist(),
            "mean_accepted_length": (emitted / np.maximum(rounds, 1)).tolist(),
        },
    }


def _decode_loop(model: LoadedTarget, drafter, spec, sampling: SamplingConfig, max_new_tokens: int, mesh, params,
                 dparams, batch):
    """(key in _COMPILED, function, its arguments) of the decoding loop for one batch = (prompts [B, Tp], lengths,
    budgets, row keys): plain decoding when spec is None, speculative (with the drafter's params) otherwise."""
    B, Tp = batch[0].shape
    if spec is None:
        fn = jax.tree_util.Partial(_ar_entry, cfg=model.cfg, sampling=sampling, eos_ids=model.eos_ids,
                                   max_new_tokens=max_new_tokens)
    else:
        fn = jax.tree_util.Partial(_spec_entry, cfg=model.cfg, eos_ids=model.eos_ids, max_new_tokens=max_new_tokens,
                                   sampling=sampling, **spec)
    key = (model.cfg, sampling, model.eos_ids, max_new_tokens, B, Tp, spec and spec["num_slots"],
           drafter and drafter.cfg, mesh)
    return key, fn, (params,) + ((dparams,) if spec else ()) + tuple(batch)


def compile_loops(model: LoadedTarget, drafter: LoadedDrafter, prompts: list[list[int]], draft_lens, *,
                  max_new_tokens: int, batch_size: int, on_compiled=lambda: None) -> None:
    """Compile the greedy decoding loops that `generate` runs on these token-id prompts (all one batch shape: equal
    lengths, one batch) for each of `draft_lens`, all at once in threads: XLA compiles outside the GIL, so the
    compilations overlap where there are cores to spare. Each is then run for one round, so its first
    launch costs are paid too, and a `generate` timed afterwards measures decoding alone."""
    B = min(batch_size, len(prompts))
    prompt_arr, lens, budget = _padded_batch(prompts[:B], B, max_new_tokens)
    keys = jax.random.split(jax.random.key(0), B)
    specs = [_speculative_setup(model, drafter, k) for k in draft_lens]
    loop = lambda spec, budget: _decode_loop(model, drafter, spec, SamplingConfig(), max_new_tokens, None,
                                             model.params, drafter.params, (prompt_arr, lens, budget, keys))

    def compile_one(spec):
        key, fn, args = loop(spec, budget)
        compiled = _COMPILED.get(key, fn, *args, precision=decode_precision(model.cfg.dtype))[0]
        on_compiled()
        return compiled

    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        compiled = list(pool.map(compile_one, specs))
    for fn, spec in zip(compiled, specs):  # a budget of 2 tokens: the prefill and one round
        jax.block_until_ready(fn(*loop(spec, jnp.minimum(budget, 2))[2]))


def _speculative_setup(model: LoadedTarget, drafter, draft_len):
    """Static options of the speculative loop, or None for plain AR decoding."""
    if drafter is None or draft_len == 0:
        return None
    k = default_draft_len(drafter) if draft_len is None else draft_len
    check_draft_len(drafter, k)
    hooks = drafter.cfg.resolved_hooks(model.cfg)
    return {"hooks": hooks, "num_slots": k, "draft_fn": specformer_drafts(model.cfg, drafter.cfg, k)}


def _ar_entry(params, prompts, lens, budget, keys, *, cfg, sampling, eos_ids, max_new_tokens):
    out, num_out, steps = ar_generate(
        params, prompts, lens, budget, keys, cfg=cfg, sampling=sampling, eos_ids=eos_ids, max_new_tokens=max_new_tokens
    )
    return {"out": out, "num_out": num_out, "steps": steps}


def _spec_entry(params, dparams, prompts, lens, budget, keys, *, cfg, eos_ids, max_new_tokens, hooks, num_slots,
                draft_fn, sampling):
    s = spec_generate(params, dparams, prompts, lens, budget, keys, cfg=cfg, hooks=hooks, draft_fn=draft_fn,
                      num_slots=num_slots, sampling=sampling, eos_ids=eos_ids, max_new_tokens=max_new_tokens)
    return {"out": s.out, "num_out": s.num_out, "steps": s.rounds, "row_rounds": s.row_rounds,
            "row_emitted": s.row_emitted, "accepted": s.accepted}
