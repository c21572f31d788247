"""A reduced draft vocabulary: chosen from the answers, drafted over exactly (greedy and sampled), scored by the loss
as the full head restricted to it, saved and loaded with the drafter, and made by training."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from test_speculative import GREEDY, KEYS, PROMPTS, Oracle, ar

from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.checkpoints.safetensors_io import read_safetensors
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.acceptance.sampling import SamplingConfig, process_logits
from specformer_jax.decoding.acceptance.speculative import choose_drafts
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.engine.plan import DecodePlan
from specformer_jax.decoding.engine.scheduler import decode_requests, run_to_end
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter
from specformer_jax.modeling.loaded import LoadedDrafter, check_drafter_fits
from specformer_jax.modeling.target import Target
from specformer_jax.training.data.draft_vocab import answer_token_counts, coverage, draft_vocabulary
from specformer_jax.training.loss import chunked_slot_ce, slot_targets

N = 20


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens():
    records = [{"input_ids": [9, 9, 9, 9, 5, 5, 3, 7], "prompt_len": 4},  # prompt tokens (9) do not count
               {"input_ids": [1, 5, 7, 2], "prompt_len": 1}]
    # answer counts: 5 x3, 7 x2, 3 x1, 2 x1 -> the top three are 5, 7 and (tie at one: the lower id) 2
    counts = answer_token_counts(records, 10)
    np.testing.assert_array_equal(draft_vocabulary(counts, 3), [2, 5, 7])
    np.testing.assert_array_equal(draft_vocabulary(counts, 6), [0, 1, 2, 3, 5, 7])  # unseen ones fill by id
    assert coverage(counts, np.array([5, 7])) == pytest.approx(5 / 7)
    with pytest.raises(SpecformerError, match="must be smaller than the target's vocabulary"):
        draft_vocabulary(counts, 10)


def test_drafts_come_from_the_draft_vocabulary_and_q_is_zero_outside_it():
    V, vocab = 40, jnp.array([1, 4, 9, 16, 25, 36], jnp.int32)
    logits = jax.random.normal(jax.random.key(0), (3, 2, vocab.size)) * 3
    full = jnp.full((3, 2, V), -jnp.inf).at[..., vocab].set(logits)  # the whole head with the rest masked out
    drafts, _ = choose_drafts(logits, None, GREEDY, vocab, V)
    np.testing.assert_array_equal(drafts, jnp.argmax(full, axis=-1))
    sampling = SamplingConfig(temperature=0.8, top_k=4)
    drafts, q = choose_drafts(logits, jax.random.split(jax.random.key(1), 3), sampling, vocab, V)
    assert q.shape == (3, 2, V) and np.isin(np.asarray(drafts), np.asarray(vocab)).all()
    np.testing.assert_allclose(q, jax.nn.softmax(process_logits(full, sampling), axis=-1), atol=1e-6)
    assert (np.take_along_axis(np.asarray(q), np.asarray(drafts)[..., None], -1) > 0).all()


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"])


@struct.dataclass
class VocabOracle(Oracle):
    """The oracle's one-hot drafts as logits over a draft vocabulary, chosen as a drafter's are (`choose_drafts`
    maps them to token ids); a token outside it drafts the vocabulary's last one."""

    vocab: jax.Array | None = None  # int32[V']
    index: jax.Array | None = None  # int32[V]: a token's logit in the draft vocabulary

    def draft(self, plan, hidden, state, num_new, slots_at, next_tokens, keys):
        best = jnp.argmax(self.logits(plan, state, slots_at, next_tokens), -1)
        logits = jax.nn.one_hot(self.index[best], self.vocab.size) * 30.0
        drafts, q = choose_drafts(logits, keys, plan.sampling, self.vocab, plan.cfg.vocab_size)
        return drafts, q, state.replace(lengths=state.lengths + num_new)


def test_perfect_drafts_over_a_draft_vocabulary_are_accepted_when_inside_it(model):
    """Oracle drafts scored over the draft vocabulary and mapped to token ids, so every AR token inside it is
    accepted and those outside cannot be drafted; the output is the AR output either way."""
    ref = ar(model, PROMPTS)
    answer = [t for r in ref for t in r[1:]]
    common = np.unique(answer)[: len(np.unique(answer)) * 2 // 3]  # most answer tokens, not all
    vocab = np.union1d(common, np.arange(0, 128, 5)).astype(np.int32)
    index = np.full(128, vocab.size - 1)
    index[vocab] = np.arange(vocab.size)  # outside: the draft is the last vocabulary token
    full = [p + r + [0] * (64 - len(p) - len(r)) for p, r in zip(PROMPTS, ref)] + [[0] * 64]
    oracle = VocabOracle(jnp.asarray(full), vocab=jnp.asarray(vocab), index=jnp.asarray(index))
    plan = DecodePlan(model.cfg, model.eos_ids, GREEDY, N, 4)
    run = run_to_end(decode_requests(plan, model.params, oracle, PROMPTS, len(PROMPTS), KEYS, schedule="static"))
    assert run.token_ids == ref
    inside = np.isin(answer, vocab).mean()
    accepted = np.asarray(run.rows["accepted"])[:, 0].sum() / np.asarray(run.rows["row_rounds"]).sum()
    assert 0.3 < accepted < 1 and inside < 1  # accepted when inside, never when outside


def reduced_drafter(model, size=48, seed=0, **kw) -> LoadedDrafter:
    cfg = DrafterConfig(num_slots=kw.pop("num_slots", 4), draft_vocab_size=size, **kw)
    ids = np.sort(np.random.default_rng(seed).choice(model.cfg.vocab_size, size, replace=False))
    return LoadedDrafter(cfg, init_drafter(model.cfg, cfg, jax.random.key(seed), ids), {})


@pytest.mark.slow  # CI time: the shipped drafter has one and decodes as before
def test_a_drafter_with_a_draft_vocabulary_is_lossless(model):
    drafter = reduced_drafter(model)
    for k in (4, 1):
        assert generate(model, PROMPTS, max_new_tokens=N, drafter=drafter, draft_len=k).token_ids == ar(model, PROMPTS)


@pytest.mark.parametrize("name", ["llama3", "qwen2"])  # a separate LM head and a tied one
@pytest.mark.parametrize("teacher", [False, True], ids=["ce", "kl"])
def test_the_loss_over_a_draft_vocabulary_is_the_full_head_restricted(tiny_checkpoints, name, teacher):
    target = load_target(tiny_checkpoints[name])
    cfg, V = target.cfg, target.cfg.vocab_size
    B, T, K, d = 2, 12, 3, cfg.hidden_size
    states = jax.random.normal(jax.random.key(0), (B, T, K, d))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    labels, weights = slot_targets(tokens, jnp.ones((B, T)), K)
    vocab = jnp.asarray(np.sort(np.random.default_rng(0).choice(V, 50, replace=False)), jnp.int32)
    labels = labels.at[0, :4].set(vocab[:1])  # some labels certainly inside
    teach = jax.random.normal(jax.random.key(2), (B, T, K, d)) if teacher else None
    got = chunked_slot_ce(cfg, target.params, states, labels, weights, 8, teach, vocab=vocab)

    head = lambda h, method=Target.head: Target(cfg).apply({"params": target.params}, h, method=method)
    logits = np.asarray(head(states), np.float64)[..., np.asarray(vocab)]  # the full head, then restricted
    logq = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lab, inside = np.asarray(labels), np.isin(np.asarray(labels), np.asarray(vocab))
    pos = np.searchsorted(np.asarray(vocab), lab)
    if teacher:
        full = np.asarray(head(teach, Target.logits), np.float64)
        p = np.exp(full - np.log(np.exp(full).sum(-1, keepdims=True)))[..., np.asarray(vocab)]
        loss = (p * (np.log(p) - logq)).sum(-1)
    else:
        loss = np.where(inside, -np.take_along_axis(logq, np.minimum(pos, 49)[..., None], -1)[..., 0], 0.0)
    w = np.asarray(weights)
    hit = (np.asarray(vocab)[logits.argmax(-1)] == lab) & (w > 0)
    np.testing.assert_allclose(got["ce_sum"], (w * loss).sum((0, 1)), rtol=2e-4)
    np.testing.assert_array_equal(got["correct"], hit.sum((0, 1)))
    assert hit[~inside].sum() == 0 and inside.any() and not inside.all()


def test_a_draft_vocabulary_is_saved_loaded_and_checked(tiny_checkpoints, tmp_path):
    target = load_target(tiny_checkpoints["qwen2"])
    drafter = reduced_drafter(target, size=32, num_slots=2)
    save_drafter(tmp_path / "d", drafter.cfg, drafter.params, target.cfg)
    names = list(read_safetensors(tmp_path / "d" / "params.safetensors"))
    assert names == sorted(names) and "draft_vocab" in names  # the file as train and draft-vocab always wrote it
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.params.vocab.dtype == jnp.int32
    np.testing.assert_array_equal(loaded.params.vocab, drafter.params.vocab)
    check_drafter_fits(loaded, target.cfg)
    bad = np.asarray(drafter.params.vocab).copy()
    bad[1] = bad[0]  # a repeated id
    save_drafter(tmp_path / "dup", drafter.cfg, drafter.params.replace(vocab=bad), target.cfg)
    with pytest.raises(SpecformerError, match="distinct token ids"):
        load_drafter(tmp_path / "dup", target)
    weights = drafter.params.replace(vocab=None)
    save_drafter(tmp_path / "none", drafter.cfg, weights, target.cfg)
    with pytest.raises(SpecformerError, match="must hold 32 token ids"):
        load_drafter(tmp_path / "none", target)
    with pytest.raises(SpecformerError, match="must hold 32 token ids"):
        check_drafter_fits(LoadedDrafter(drafter.cfg, weights, {}), target.cfg)
    with pytest.raises(SpecformerError, match="this drafter holds parameters its drafter settings do not have"):
        check_drafter_fits(LoadedDrafter(DrafterConfig(num_slots=2), drafter.params, {}), target.cfg)
    save_drafter(tmp_path / "stray", DrafterConfig(num_slots=2), drafter.params, target.cfg)  # config without it
    with pytest.raises(SpecformerError, match="safetensors holds parameters its drafter settings do not have: draft_v"):
        load_drafter(tmp_path / "stray", target)


@pytest.mark.slow  # CI time: test_train_cli.py makes a draft vocabulary for a trained drafter in `make test`
def test_training_makes_and_ships_a_draft_vocabulary(tiny_checkpoints, tmp_path, monkeypatch):
    from test_training import config

    from specformer_jax.training import trainer

    target = load_target(tiny_checkpoints["llama3"])
    prompts = np.random.default_rng(0).integers(3, 128, size=(24, 6)).tolist()
    answers = generate(target, prompts, max_new_tokens=20, batch_size=24).token_ids
    recs = [{"index": i, "input_ids": p + a, "prompt_len": 6} for i, (p, a) in enumerate(zip(prompts, answers))]
    monkeypatch.setattr(trainer, "load_records", lambda *a, **k: recs)
    monkeypatch.setattr(trainer, "check_vocabulary", lambda *a: None)
    trainer.train(config(tiny_checkpoints, tmp_path, draft_vocab_size=40, steps=4, eval_every=4, save_every=4),
                  progress=False)
    meta = json.loads((tmp_path / "drafter" / "drafter.json").read_text())
    train_recs = trainer.split(recs, 0.1)[0]
    counts = answer_token_counts(train_recs, 128)
    want = draft_vocabulary(counts, 40)
    assert meta["drafter"]["draft_vocab_size"] == 40
    assert meta["draft_vocab"]["coverage_train"] == pytest.approx(coverage(counts, want), abs=1e-4)
    drafter = load_drafter(tmp_path / "drafter", target)
    np.testing.assert_array_equal(drafter.params.vocab, want)
    prompts = prompts[:5]
    assert (generate(target, prompts, max_new_tokens=N, drafter=drafter, draft_len=3).token_ids
            == generate(target, prompts, max_new_tokens=N).token_ids)
    # resuming on data that makes another vocabulary is refused; a full-vocabulary drafter starts a V' run
    monkeypatch.setattr(trainer, "draft_vocabulary", lambda *a: np.roll(want, 1))
    with pytest.raises(SpecformerError, match="another draft vocabulary"):
        trainer.train(config(tiny_checkpoints, tmp_path, draft_vocab_size=40, steps=6), resume=True, progress=False)
    full = DrafterConfig(num_slots=3)
    save_drafter(tmp_path / "full", full, init_drafter(target.cfg, full, jax.random.key(3)), target.cfg)
    start = trainer.initial_params(config(tiny_checkpoints, tmp_path / "r", draft_vocab_size=40,
                                          init_from=str(tmp_path / "full")), target)
    np.testing.assert_array_equal(start["expand"]["kernel"],
                                  load_drafter(tmp_path / "full", target).params.weights["expand"]["kernel"])
