"""Greedy speculative decoding equals greedy AR decoding for every row of a ragged batch, whatever the drafts."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import statistics
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import choose_drafts
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine import bound
from specformer_jax.decoding.engine.bound import BOUND
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.scheduler import decode_requests, run_to_end
from specformer_jax.decoding.tuning.draft_len import default_draft_len, default_round
from specformer_jax.modeling.drafter import drafter_cache, init_drafter
from specformer_jax.modeling.loaded import LoadedDrafter, cpu_kernels_ready

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [9, 4, 120], [33, 21, 56, 78, 10, 3, 44, 6, 70, 71, 72], [11, 12],
           [100, 101, 102, 103, 104], [60], [7, 7, 7, 8, 8, 8, 9, 9]]
N = 20
GREEDY = SamplingConfig()
KEYS = jax.random.split(jax.random.key(0), len(PROMPTS))


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"])


def ar(model, prompts, **kw):
    return generate(model, prompts, max_new_tokens=N, **kw).token_ids


class OracleSource:
    """What the tests' oracle draft sources (decoding/draft_source.py) share: they read no hidden state, keep a
    drafter's cache for its lengths (where each row stands), and derive nothing from the target."""

    def hooks(self, plan):
        return ()

    def empty_state(self, plan, rows, max_len):
        return drafter_cache(plan.cfg, rows, max_len)

    origins = ("oracle",)

    def bind(self, plan, params):
        return self

    def origin(self, state):
        return None

    def widths(self, plan):
        return (plan.draft_len,)


@struct.dataclass
class Oracle(OracleSource):
    """Drafts that know the AR continuation: perfect (shift=0) or never right (shift=1). Like a drafter with a
    next-token input, it is right only when told the token after each new position up to its drafting position (what
    a context-level input reads), so the perfect one also checks that the loop passes those tokens."""

    seqs: jax.Array  # int32[rows, 64]: prompt and continuation of each slot's request
    shift: int = struct.field(pytree_node=False, default=0)

    def logits(self, plan, state, slots_at, next_tokens):
        """One-hot logits [B, k, 128] of the oracle's drafts."""
        at = lambda pos: jnp.take_along_axis(self.seqs[: pos.shape[0]], jnp.minimum(pos, self.seqs.shape[1] - 1), 1)
        t = state.lengths[:, None] + slots_at  # the drafting position
        tok = at(t + 2 + jnp.arange(plan.draft_len)[None, :])  # slot i at t predicts t + 2 + i
        j = jnp.arange(next_tokens.shape[1])[None, :]
        told = (next_tokens == at(state.lengths[:, None] + j + 1)) | (j > slots_at)  # positions past t: not kept
        tok = jnp.where(jnp.all(told, axis=1, keepdims=True), tok, tok + 1)
        return 30.0 * jax.nn.one_hot((tok + self.shift) % 128, 128)

    def draft(self, plan, hidden, state, num_new, slots_at, next_tokens, keys):
        drafts, q = choose_drafts(self.logits(plan, state, slots_at, next_tokens), keys, plan.sampling)
        return drafts, q, state.replace(lengths=state.lengths + num_new)


def oracle_drafts(sequences, shift=0) -> Oracle:
    return Oracle(jnp.asarray(sequences), shift)


def oracle_run(model, prompts, k, continuations, shift=0, eos_ids=(), max_new=N):
    """Speculative decoding with oracle drafts from `continuations` (one static batch: slot i holds prompt i)."""
    full = [p + r + [0] * (64 - len(p) - len(r)) for p, r in zip(prompts, continuations)]
    full += [[0] * 64] * (8 - len(full))  # the prefill block is padded to a power of two rows
    plan = DecodePlan(model.cfg, eos_ids, GREEDY, max_new, k)
    return run_to_end(decode_requests(plan, model.params, oracle_drafts(full, shift), prompts, len(prompts),
                                      KEYS[: len(prompts)], schedule="static"))


def run_oracle(model, prompts, k, shift, eos_ids, max_new=N):
    ref = generate(dataclasses.replace(model, eos_ids=eos_ids), prompts, max_new_tokens=max_new).token_ids
    run = oracle_run(model, prompts, k, ref, shift, eos_ids, max_new)
    return ref, run.token_ids, run


# CI time: 7 ragged rows cover 1; the bidirectional drafter on the engine's pool is in test_engine.py
@pytest.mark.parametrize("rows", [pytest.param(1, marks=pytest.mark.slow), 7])
@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) for v in ("bidirectional", "causal")]
                         + [pytest.param(v, marks=pytest.mark.slow) for v in ("next_token", "context_token")])
def test_specformer_drafter_is_lossless(model, rows, variant):
    cfg = DrafterConfig(num_slots=4, slot_attention="causal" if variant == "causal" else "bidirectional",
                        next_token_input=variant == "next_token", context_token_input=variant == "context_token")
    params = init_drafter(model.cfg, cfg, jax.random.key(rows))
    if cfg.next_token_input:  # zero at init; make the input matter
        w = params.weights["next_proj"]["kernel"]
        params.weights["next_proj"]["kernel"] = 0.05 * jax.random.normal(jax.random.key(9), w.shape, w.dtype)
    drafter = LoadedDrafter(cfg, params, {})
    prompts = PROMPTS[:rows]
    for k in (4, 2):
        res = generate(model, prompts, max_new_tokens=N, drafter=drafter, draft_len=k)
        assert res.token_ids == ar(model, prompts)
        st = res.stats
        assert len(st["acceptance_rate_per_slot"]) == k and st["rounds"] >= 1
        assert 1.0 <= st["mean_accepted_length"] <= k + 1


def test_a_drafter_is_bound_to_a_target_once_and_lets_its_weights_go(model, tiny_checkpoints, monkeypatch):
    """A second call with the same drafter and target weights decodes with what the first bound (engine/bound.py: the
    drafter packed for the CPU kernels, the target's head cut to its vocabulary), to the same tokens; another drafter
    or another target's weights are bound anew; a dropped target or drafter takes its binding with it."""
    if not model.use_decoding_layout(3).cfg.pack_weights:
        pytest.skip("off the CPU kernels a binding holds the drafter's own weights and is not kept")
    monkeypatch.setattr(bound, "SMALL", 1000)  # the tiny model's matrices count as large (matched by identity)
    binds = []
    bind = SpecformerDrafts.bind
    monkeypatch.setattr(SpecformerDrafts, "bind", lambda self, plan, p: binds.append(1) or bind(self, plan, p))
    cfg = DrafterConfig(num_slots=2)
    drafter, other = (LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(i)), {}) for i in (3, 4))
    run = lambda m, d: generate(m, PROMPTS[:3], max_new_tokens=8, drafter=d, draft_len=2).token_ids
    first = run(model, drafter)
    assert run(model, drafter) == first == generate(model, PROMPTS[:3], max_new_tokens=8).token_ids
    assert len(binds) == 1
    (replaced,) = BOUND._entries
    run(model, other)
    assert len(binds) == 2
    assert not any(f.alive for f in replaced.finalizers)  # the model lives on, without a finalizer per old binding
    twin = load_target(tiny_checkpoints["qwen2"])
    assert run(twin, other) == run(model, other)
    assert len(binds) == 4  # the twin's arrays are not the model's: bound for each in turn
    run(twin, other)
    gone = weakref.ref(jax.tree.leaves(twin.params["layers_0"])[0])
    del twin
    gc.collect()
    assert gone() is None and len(BOUND) == 0
    run(model, other)
    gone = weakref.ref(jax.tree.leaves(other.params.weights)[0])
    del other
    gc.collect()
    assert gone() is None and len(BOUND) == 0


def test_perfect_drafter_accepts_everything(model):
    ref, got, s = run_oracle(model, PROMPTS, k=4, shift=0, eos_ids=())
    assert got == ref
    # every full round emits k + 1 tokens: N - 1 tokens after the prefill token in ceil((N - 1) / 5) rounds
    np.testing.assert_array_equal(s.rows["row_rounds"], -(-(N - 1) // 5))
    assert (np.asarray(s.rows["accepted"]) == np.asarray(s.rows["row_rounds"])[:, None]).all()  # every slot and round


def test_useless_drafter_accepts_nothing(model):
    ref, got, s = run_oracle(model, PROMPTS, k=4, shift=1, eos_ids=())
    assert got == ref
    assert int(np.asarray(s.rows["accepted"]).sum()) == 0
    np.testing.assert_array_equal(s.rows["row_rounds"], N - 1)  # one token per round, like AR


@pytest.mark.slow  # CI time: test_engine.py ends requests by EOS and budget inside rounds too
def test_eos_inside_a_round_and_budget_hit_mid_round(model):
    base = generate(model, PROMPTS, max_new_tokens=N).token_ids
    row0 = base[0]
    j = next(i for i in range(3, len(row0)) if row0[i] not in row0[:i])  # first new token after step 3: EOS
    eos = (row0[j],)
    for max_new in (N, 13):  # 13 - 1 = 12 is not a multiple of 5: the budget ends mid-round
        ref, got, s = run_oracle(model, PROMPTS, k=4, shift=0, eos_ids=eos, max_new=max_new)
        assert got == ref
        assert got[0][-1] == eos[0] and len(got[0]) == j + 1
        assert all(len(g) <= max_new for g in got)


def test_drafts_never_add_tokens_after_eos(model):
    """The oracle keeps proposing the continuation that follows EOS; none of it may be emitted."""
    free = generate(model, PROMPTS, max_new_tokens=N).token_ids
    eos = (free[2][4],)
    model_eos = dataclasses.replace(model, eos_ids=eos)
    want = generate(model_eos, PROMPTS, max_new_tokens=N).token_ids
    got = oracle_run(model, PROMPTS, 4, free, eos_ids=eos).token_ids
    assert got == want
    for g in got:
        assert eos[0] not in g[:-1]


def test_cli_generate_with_a_drafter_directory(model, tiny_checkpoints, tmp_path, capsys, cli_error):
    import json

    from specformer_jax.checkpoints.drafter_io import save_drafter
    from specformer_jax.cli import main

    cfg = DrafterConfig(num_slots=3)
    save_drafter(tmp_path / "d", cfg, init_drafter(model.cfg, cfg, jax.random.key(0)), model.cfg, dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    base = ["generate", "--model", str(tiny_checkpoints["qwen2"]), "--prompts-file", str(prompts), "--json",
            "--max-new-tokens", "12", "--batch-size", "1"]
    assert main(base + ["--drafter", str(tmp_path / "d")]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(base + ["--drafter", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert [r["token_ids"] for r in spec["results"]] == [r["token_ids"] for r in plain["results"]]
    default_k = default_draft_len(LoadedDrafter(cfg, None, {}), 1, cpu_kernels_ready(model.cfg))  # a pool of 1
    assert len(spec["stats"]["acceptance_rate_per_slot"]) == default_k and "mean_accepted_length" not in plain["stats"]
    assert "draft_len must be in 0..3" in cli_error(base + ["--drafter", str(tmp_path / "d"), "--draft-len", "5"])
    more = tmp_path / "more.jsonl"  # 14 prompts, a pool of 9: on a CPU with its kernels the default drafts none
    more.write_text(prompts.read_text() * 2)
    pooled_args = base[:-1] + ["9", "--drafter", str(tmp_path / "d")]
    assert main([str(more) if a == str(prompts) else a for a in pooled_args]) == 0
    out = capsys.readouterr()
    pooled = json.loads(out.out)["stats"]
    told = "no draft length pays at batch 9 here; --draft-len K drafts anyway" in out.err
    assert told == (pooled["draft_len"] == 0) and pooled["draft_len"] == default_round(
        LoadedDrafter(cfg, None, {}), 9, cpu_kernels_ready(model.cfg))[0]


def test_bench_reports_ar_and_speculative_per_batch_size(model, tiny_checkpoints, tmp_path, cli_error, monkeypatch):
    import json

    from specformer_jax.checkpoints.drafter_io import save_drafter
    from specformer_jax.cli import bench, main

    writes = []  # the result file is rewritten after every batch size, so an interrupted run keeps what it measured

    def write_json(path, doc):
        writes.append((len(doc["results"]), doc["complete"]))
        real_write_json(path, doc)

    real_write_json = bench.write_json
    monkeypatch.setattr(bench, "write_json", write_json)

    cfg = DrafterConfig(num_slots=3)
    save_drafter(tmp_path / "d", cfg, init_drafter(model.cfg, cfg, jax.random.key(0)), model.cfg, dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    argv = ["bench", "--model", str(tiny_checkpoints["qwen2"]), "--drafter", str(tmp_path / "d"), "--prompts",
            str(prompts), "--batch-sizes", "1,4", "--max-new-tokens", "10", "--draft-len", "3", "--repeats", "2",
            "--num-requests", "9", "--schedule", "both", "--chunk-rounds", "4",
            "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    assert main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["command"].startswith("specformer bench --model") and result["draft_len"] == 3
    assert result["drafter_sha256"] == hashlib.sha256((tmp_path / "d" / "params.safetensors").read_bytes()).hexdigest()
    assert [r["batch_size"] for r in result["results"]] == [1, 4] and result["complete"]
    assert writes == [(1, False), (2, True)]
    for r in result["results"]:
        assert r["output_equivalence"] == 1.0 and r["num_rows"] == 9
        assert set(r["continuous_over_static"]) == {"ar", "spec"} and r["speedup_static"] > 0
        assert r["spec"]["schedule"] == "continuous" and r["spec_static"]["schedule"] == "static"
        assert "batch_accepted_length" in r["spec_static"] and "batch_accepted_length" not in r["spec"]
        assert 0 < r["ar"]["latency_seconds"]["p50"] <= r["ar"]["latency_seconds"]["p99"]
        assert r["ar"]["requests_per_second"] > 0 and r["spec"]["chunk_rounds"] == 4
        for side in ("ar", "spec", "ar_static", "spec_static"):  # each side timed twice, alternating; median
            assert len(r[side]["tokens_per_second_runs"]) == 2
            assert r[side]["tokens_per_second"] == statistics.median(r[side]["tokens_per_second_runs"])
        pairs = zip(r["spec"]["tokens_per_second_runs"], r["ar"]["tokens_per_second_runs"])
        assert r["speedup"] == pytest.approx(statistics.median(s / a for s, a in pairs))
        assert len(r["spec"]["acceptance_rate_per_slot"]) == 3
        assert r["ar"]["decode_steps"] >= 1 and r["spec"]["decode_steps"] >= 1  # loop iterations: cost per step
    assert (tmp_path / "r.png").stat().st_size > 0
    assert result["model_facts"]["drafter_weight_bytes"] > 0
    assert result["device_measured"]["read_bandwidth_gb_per_s"] > 0
    assert main(["report", str(tmp_path / "r.json"), "--out", str(tmp_path / "r.md")]) == 0
    report = (tmp_path / "r.md").read_text()
    assert report.count("| 4 | ") == 2  # the batch-4 row, and its TPU estimates
    assert "| 4 | 3 | " in report and "TPU v5p (estimate)" in report
    assert "--batch-sizes" in cli_error(argv[:-4] + ["--batch-sizes", "1,x", "--out", str(tmp_path / "q.json")])
    assert "is not a file" in cli_error(argv[:-4] + ["--out", str(tmp_path)])
    assert "which is a file" in cli_error(argv[:-4] + ["--out", str(tmp_path / "r.json" / "x.json")])
