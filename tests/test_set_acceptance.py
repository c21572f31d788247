"""Random-weight targets and set acceptance (the cost-measurement mode of `bench --set-acceptance`): the accepted
drafts follow the set law, the caches stay those of the emitted tokens (real rounds after set ones decode what plain
decoding of that prefix gives), and `bench --model random:tiny` runs end to end into `report`."""

from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.set_acceptance import SetAcceptance, law_accepted_length
from specformer_jax.decoding.acceptance.speculative import Verify
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine import runner
from specformer_jax.decoding.engine.chunk import run_chunk
from specformer_jax.decoding.engine.plan import make_plan
from specformer_jax.decoding.engine.pool import cache_len, empty_pool, insert
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.errors import SpecformerError

PROMPTS = [[(11 * i + 5 * r + 3) % 250 + 1 for i in range(n)] for r, n in enumerate([6, 17, 3, 25, 9, 12])]
GREEDY = SamplingConfig(0.0, 0, 1.0)


@pytest.fixture(scope="module")
def tiny():
    """random:tiny in float32 (exact comparisons) with a random drafter of 8 slots."""
    model = load_target("random:tiny", dtype="float32")
    return model, resolve_drafter("random", model)


def test_random_targets_have_the_published_shapes_and_no_eos(tiny):
    model, drafter = tiny
    assert model.eos_ids == () and model.tokenizer is None and model.cfg.unroll_layers
    assert drafter.cfg.num_slots == 8
    big = jax.eval_shape(lambda: load_target("random:llama-3.1-8b").params)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(big))
    assert 8.0e9 < count < 8.1e9  # Llama-3.1-8B: 8.03B parameters
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(big))


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_accepted_drafts_follow_the_set_law(tiny, rate):
    model, drafter = tiny
    k = 4
    res = generate(model, PROMPTS * 3, max_new_tokens=40, batch_size=4, drafter=drafter, draft_len=k,
                   set_acceptance=rate, chat=False)
    s = res.stats
    assert s["law_accepted_length"] == pytest.approx(law_accepted_length(rate, k))
    assert all(len(t) == 40 for t in res.token_ids)  # no EOS: every answer runs to its budget
    for i, measured in enumerate(s["acceptance_rate_per_slot"]):  # P(slot i accepted) = rate^(i + 1)
        p = rate ** (i + 1)
        assert abs(measured - p) <= 4 * math.sqrt(p * (1 - p) / s["rounds"]) + 1e-9, (i, measured, p)


def test_rates_share_one_compilation(tiny, monkeypatch):
    """The rate is data the round is given, not part of the compiled plan: a sweep over rates compiles its chunk
    once. A fresh cache, so that entries other tests left cannot be evicted in between."""
    model, drafter = tiny
    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())
    for rate in (0.3, 0.9):
        res = generate(model, PROMPTS[:2], max_new_tokens=6, batch_size=2, drafter=drafter, draft_len=2,
                       set_acceptance=rate, chat=False)
        assert res.stats["set_acceptance"] == rate
    assert runner.COMPILED.count(run_chunk) == 1


@pytest.mark.slow  # CI time: set rounds are tested above
def test_real_rounds_after_set_ones_decode_the_targets_tokens(tiny):
    """Set acceptance for a chunk, then verified rounds: what follows equals plain decoding of the prompt plus the
    tokens emitted so far, so the set rounds left the caches exactly as a real round with those tokens would."""
    model, drafter = tiny
    N, rows = 30, 3
    plan = make_plan(model, 3, GREEDY, N)
    source = SpecformerDrafts(drafter.cfg, drafter.params).bind(plan, model.params)
    chunk = functools.partial(jax.jit, static_argnums=(0, 1, 2))(run_chunk)
    width = max(map(len, PROMPTS[:rows]))
    block = np.zeros((rows, width), np.int32)
    for r, p in enumerate(PROMPTS[:rows]):
        block[r, : len(p)] = p
    pool = empty_pool(plan, rows, cache_len(plan, width), source)
    pool = insert(plan, model.params, source, pool, jnp.asarray(block),
                  jnp.asarray([len(p) for p in PROMPTS[:rows]], jnp.int32), jnp.arange(rows, dtype=jnp.int32),
                  jnp.full((rows,), N, jnp.int32), jax.random.split(jax.random.key(0), rows))
    pool = chunk(plan, 4, 3, model.params, source, SetAcceptance(jnp.float32(0.7)), pool)
    mid = np.asarray(pool.num_out)
    for _ in range(2):
        pool = chunk(plan, 4, 3, model.params, source, Verify(), pool)
    out, end = np.asarray(pool.out), np.asarray(pool.num_out)
    assert (mid > 4).all() and (end > mid).all()
    for r in range(rows):
        prefix = PROMPTS[r] + out[r, : mid[r]].tolist()
        plain = generate(model, [prefix], max_new_tokens=int(end[r] - mid[r]), batch_size=1, chat=False)
        assert out[r, mid[r]: end[r]].tolist() == plain.token_ids[0], r


def test_set_acceptance_needs_speculative_decoding_with_a_fixed_draft_len(tiny):
    model, drafter = tiny
    with pytest.raises(SpecformerError, match="set_acceptance needs speculative decoding"):
        generate(model, PROMPTS[:1], max_new_tokens=4, set_acceptance=0.5, chat=False)
    with pytest.raises(SpecformerError, match="set_acceptance needs speculative decoding"):
        generate(model, PROMPTS[:1], max_new_tokens=4, drafter=drafter, draft_len=0, set_acceptance=0.5, chat=False)
    with pytest.raises(SpecformerError, match="set_acceptance"):
        generate(model, PROMPTS[:1], max_new_tokens=4, drafter=drafter, draft_len=2, set_acceptance=1.5, chat=False)
    with pytest.raises(SpecformerError, match="unknown random model 'gpt-9'"):
        load_target("random:gpt-9")


@pytest.mark.slow  # CI time: the set law and bench are each tested in `make test`; this runs them together
def test_bench_on_a_random_model_with_set_acceptance_runs_into_report(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "report.md"
    assert main(["bench", "--model", "random:tiny", "--set-acceptance", "0.5,0.9", "--batch-sizes", "1,2",
                 "--draft-len", "3", "--max-new-tokens", "8", "--num-requests", "3", "--repeats", "1",
                 "--out", str(out), "--plot", str(tmp_path / "bench.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["drafter"] == "random" and doc["dtype"] == "bfloat16" and doc["complete"]
    assert "meaningless" in doc["set_acceptance"]["note"]
    rows = doc["results"]
    assert [(r["batch_size"], r["set_acceptance"]) for r in rows] == [(1, 0.5), (1, 0.9), (2, 0.5), (2, 0.9)]
    for r in rows:
        assert "output_equivalence" not in r  # the speculative text is meaningless under set acceptance
        assert r["spec"]["law_accepted_length"] == pytest.approx(law_accepted_length(r["set_acceptance"], 3))
        assert 1.0 <= r["spec"]["mean_accepted_length"] <= 4.0 and r["speedup"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert main(["report", str(out), "--out", str(md)]) == 0
    text = md.read_text()
    assert "| 2, a = 0.9 |" in text and "TPU v6e (estimate)" in text and "Estimates, not measurements" in text
    assert f"(law {law_accepted_length(0.9, 3):.2f})" in text  # the set law's accepted length beside the measured


def test_bench_refuses_set_acceptance_without_a_drafter(cli_error):
    line = cli_error(["bench", "--model", "random:tiny", "--drafter", "none", "--set-acceptance", "0.5",
                      "--out", "/tmp/never.json"])
    assert "--set-acceptance needs speculative decoding" in line
