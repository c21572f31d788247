"""The engine's pool, chunks and schedules: every request decodes what plain decoding of that prompt alone gives,
whatever slot it lands in, when it is inserted, the pool size and the rounds per chunk; sampled requests do not
depend on their neighbours; streaming and Ctrl-C stop at chunk boundaries."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from test_speculative import OracleSource

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig
from specformer_jax.decoding.acceptance.speculative import choose_drafts
from specformer_jax.decoding.api import generate, generate_stream
from specformer_jax.decoding.drafts.draft_source import SpecformerDrafts
from specformer_jax.decoding.engine.plan import DecodePlan, make_plan
from specformer_jax.decoding.engine.scheduler import Interrupted, decode_requests, run_to_end
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.kv_cache import target_cache
from specformer_jax.modeling.target import Target

# 11 requests: prompt lengths 1..40 (two prompt buckets), budgets 1..24, so rows finish at different rounds
LENGTHS = [5, 1, 12, 33, 2, 7, 40, 3, 9, 18, 4]
PROMPTS = [[(7 * i + 3 * r + 1) % 120 + 1 for i in range(n)] for r, n in enumerate(LENGTHS)]
BUDGETS = [24, 3, 17, 1, 24, 9, 14, 24, 6, 20, 11]
N = 24


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    m = load_target(tiny_checkpoints["qwen2"])
    free = [plain_alone(m, p, N) for p in PROMPTS]
    eos = next(t for t in free[0][3:] if t not in free[0][:3])  # EOS mid-answer for some of the requests
    return dataclasses.replace(m, eos_ids=(eos,))


@functools.cache
def _step(cfg):
    return jax.jit(lambda p, t, c: Target(cfg).apply({"params": p}, t, c))


def plain_alone(model, prompt, budget):
    """Greedy decoding of one prompt, a token at a time (the prompt too) with the target's forward: the reference,
    no engine involved."""
    step, cache = _step(model.cfg), target_cache(model.cfg, 1, 64)
    for t in prompt:
        logits, cache, _ = step(model.params, jnp.asarray([[t]]), cache)
    out = []
    while len(out) < budget:
        out.append(int(jnp.argmax(logits[0, -1])))
        if out[-1] in model.eos_ids:
            break
        logits, cache, _ = step(model.params, jnp.asarray([[out[-1]]]), cache)
    return out


@pytest.fixture(scope="module")
def reference(model):
    return [plain_alone(model, p, b) for p, b in zip(PROMPTS, BUDGETS)]


@struct.dataclass
class TableOracle(OracleSource):
    """Drafts that know the reference continuations, looked up by (drafting position, token just emitted) and not by
    slot, so they stay right whichever slot a request lands in: rounds accept several tokens, and EOS and budgets
    fall inside them."""

    table: jax.Array  # int32[positions, 256, k]

    def draft(self, plan, hidden, state, num_new, slots_at, next_tokens, keys):
        after = jnp.take_along_axis(next_tokens, slots_at, axis=1)[:, 0]  # the token after the drafting position
        tok = self.table[state.lengths + slots_at[:, 0], after]  # [B, k]
        drafts, q = choose_drafts(30.0 * jax.nn.one_hot(tok, plan.cfg.vocab_size), keys, plan.sampling)
        return drafts, q, state.replace(lengths=state.lengths + num_new)


def oracle_drafts(reference, k=3, positions=64) -> TableOracle:
    table = np.zeros((positions, 256, k), np.int32)
    for prompt, answer in zip(PROMPTS, reference):
        seq = prompt + answer + [0] * (k + 1)
        for t in range(len(prompt) + len(answer) - 1):
            table[t, seq[t + 1]] = seq[t + 2: t + 2 + k]
    return TableOracle(jnp.asarray(table))


def run(plan: DecodePlan, model, source=None, pool=3, schedule="continuous", order=None, keys=None, rounds=8):
    order = list(range(len(PROMPTS))) if order is None else order
    keys = jax.random.split(jax.random.key(0), len(PROMPTS)) if keys is None else keys
    result = run_to_end(decode_requests(plan, model.params, source, [PROMPTS[i] for i in order], pool,
                                        keys[np.asarray(order)], chunk_rounds=rounds, schedule=schedule,
                                        budgets=[BUDGETS[i] for i in order]))
    tokens = [None] * len(order)
    for got, i in zip(result.token_ids, order):
        tokens[i] = got
    return tokens, result


@pytest.mark.parametrize("rounds", [1, pytest.param(4, marks=pytest.mark.slow), 16])  # CI time: 4 runs with -m slow
@pytest.mark.parametrize("schedule", ["continuous", "static"])
def test_every_request_equals_plain_decoding_of_its_prompt(model, reference, rounds, schedule):
    greedy = SamplingConfig()
    plain = DecodePlan(model.cfg, model.eos_ids, greedy, N)
    oracle = DecodePlan(model.cfg, model.eos_ids, greedy, N, 3)
    assert run(plain, model, schedule=schedule, rounds=rounds)[0] == reference
    tokens, result = run(oracle, model, oracle_drafts(reference), schedule=schedule, rounds=rounds)
    assert tokens == reference
    stats = result.speculative_stats()
    assert stats["mean_accepted_length"] > 1.3  # rounds of several tokens: EOS and budgets land inside them
    assert ("batch_accepted_length" in stats) == (schedule == "static")
    for got in tokens:  # nothing after an EOS
        assert model.eos_ids[0] not in got[:-1]


@pytest.mark.parametrize("schedule", ["continuous", "static"])
def test_chunks_that_stop_early_run_no_idle_round_and_decode_the_same(model, reference, schedule):
    """DecodePlan.stop_early (a CPU's chunks): a chunk ends after the round in which a row finished, so every round
    run has a live row, where fixed chunks of 16 run on after the answers end (and, continuous, keep a finished
    row's slot idle until the chunk ends); the tokens and each request's rounds are the same."""
    greedy = SamplingConfig()
    for k, source in ((0, None), (3, oracle_drafts(reference))):
        fixed = DecodePlan(model.cfg, model.eos_ids, greedy, N, k)
        early = dataclasses.replace(fixed, stop_early=True)
        (tokens, result), (fixed_tokens, fixed_result) = (run(p, model, source, schedule=schedule, rounds=16)
                                                          for p in (early, fixed))
        assert tokens == fixed_tokens == reference
        assert result.rounds_run == result.steps < fixed_result.rounds_run
        assert result.live_row_rounds == fixed_result.live_row_rounds  # each request ran the same rounds
        assert result.steps <= fixed_result.steps  # continuous: a freed slot is refilled without idling


@pytest.mark.parametrize("pool, backwards", [(3, False), pytest.param(5, True, marks=pytest.mark.slow)])
def test_a_specformer_drafter_on_the_pool_is_lossless(model, reference, pool, backwards):
    cfg = DrafterConfig(num_slots=3)
    source = SpecformerDrafts(cfg, init_drafter(model.cfg, cfg, jax.random.key(3)))
    order = list(range(len(PROMPTS)))[::-1] if backwards else None
    plan = make_plan(model, 2, SamplingConfig(), N)
    assert run(plan, model, source, pool=pool, order=order, rounds=4)[0] == reference


# plain decoding's samples against batch composition are also checked in test_decoding.py, in `make test`
@pytest.mark.slow  # CI time: speculative samples against the target's distribution: test_speculative_sampling.py
@pytest.mark.parametrize("draft_len", [0, 2])
def test_sampled_requests_do_not_depend_on_pool_size_or_insertion_order(model, draft_len):
    cfg = DrafterConfig(num_slots=3)
    source = SpecformerDrafts(cfg, init_drafter(model.cfg, cfg, jax.random.key(3))) if draft_len else None
    sampling = SamplingConfig(temperature=1.0, top_k=50)
    keys = jax.random.split(jax.random.key(7), len(PROMPTS))
    plan = make_plan(model, draft_len, sampling, N)
    first = run(plan, model, source, pool=3, keys=keys, rounds=4)[0]
    backwards = list(range(len(PROMPTS)))[::-1]
    assert run(plan, model, source, pool=5, schedule="static", order=backwards, keys=keys, rounds=4)[0] == first
    other = run(plan, model, source, pool=3, keys=jax.random.split(jax.random.key(8), len(PROMPTS)), rounds=4)[0]
    assert other != first  # the keys do matter


def test_streamed_tokens_add_up_to_the_results(model):
    stream = generate_stream(model, PROMPTS, max_new_tokens=N, batch_size=3, chunk_rounds=4)
    seen = [[] for _ in PROMPTS]
    while True:
        try:
            index, tokens = next(stream)
        except StopIteration as end:
            result = end.value
            break
        assert tokens
        seen[index] += tokens
    assert seen == result.token_ids == generate(model, PROMPTS, max_new_tokens=N, batch_size=3).token_ids
    assert result.stats["schedule"] == "continuous" and result.stats["chunk_rounds"] == 4


def test_ctrl_c_stops_at_the_next_chunk_boundary(model):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under a shell's background job
    stream = generate_stream(model, PROMPTS, max_new_tokens=N, batch_size=2, chunk_rounds=2)
    next(stream)
    os.kill(os.getpid(), signal.SIGINT)  # the engine's handler notes it; the chunk in flight finishes
    with pytest.raises(Interrupted, match=r"stopped at a chunk boundary: \d+ of 11 requests finished") as err:
        for _ in stream:
            pass
    assert err.value.finished < len(PROMPTS)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_bad_schedule_and_chunk_rounds_are_refused(model):
    from specformer_jax.errors import SpecformerError

    with pytest.raises(SpecformerError, match="schedule must be one of continuous, static"):
        generate(model, PROMPTS[:1], schedule="fifo")
    with pytest.raises(SpecformerError, match="chunk_rounds"):
        generate(model, PROMPTS[:1], chunk_rounds=0)


def test_the_cli_streams_a_single_prompt_on_a_terminal(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    import shutil
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specformer_jax.cli import main

    d = tmp_path / "m"
    shutil.copytree(tiny_checkpoints["llama3"], d)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(d)
    argv = ["generate", "--model", str(d), "--prompt", "w5 w17 w3", "--no-chat", "--max-new-tokens", "12",
            "--chunk-rounds", "2"]
    assert main(argv) == 0
    whole = capsys.readouterr().out  # not a terminal: printed when done
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(argv) == 0
    streamed = capsys.readouterr().out
    text = whole.split("\n")[1]
    assert whole.startswith(">>> w5 w17 w3\n") and len(text.split()) == 12
    assert streamed == f">>> w5 w17 w3\n{text}\n\n"
