"""`specformer sample-prompts`: user requests sampled from the default model, deduplicated, resumable, kept clean."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.errors import SpecformerError
from specformer_jax.training.data import self_prompts as sp
from specformer_jax.training.data.prompts import normalise_prompt

KW = dict(max_new_tokens=48, batch_size=8, progress=False)


@pytest.fixture(scope="module")
def model():
    return load_target("default")


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prefix_is_the_chat_template_up_to_the_user_message(model):
    text = model.tokenizer.decode(sp.user_turn_prefix(model))
    assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")


SYSTEM = "You are a programming assistant."


def test_a_system_message_replaces_the_default_one_in_the_prefix(model):
    prefix = sp.user_turn_prefix(model, SYSTEM)
    assert model.tokenizer.decode(prefix) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    with pytest.raises(SpecformerError, match="system message is empty"):
        sp.user_turn_prefix(model, "  ")


@pytest.mark.slow  # CI time: sampling under the default system message runs in `make test` (the tests below)
def test_requests_are_sampled_after_the_system_messages_prefix(model, tmp_path, monkeypatch):
    prefix = sp.user_turn_prefix(model, SYSTEM)
    seen = []
    real = sp.generate
    monkeypatch.setattr(sp, "generate", lambda m, prompts, **kw: seen.append(prompts[0]) or real(m, prompts, **kw))
    sp.sample_prompts(model, 2, tmp_path / "p.jsonl", seed=3, system=SYSTEM, **KW)
    assert seen and all(p == prefix for p in seen)


@pytest.fixture(scope="module")
def sampled(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("sampled") / "p.jsonl"
    return out, sp.sample_prompts(model, 6, out, seed=3, **KW)


def test_samples_are_finished_distinct_requests_and_a_rerun_extends_the_file(model, sampled):
    out, first = sampled
    assert len(first) == 6 and len({normalise_prompt(p) for p in first}) == 6
    assert all(len(p) >= sp.MIN_CHARS and p == p.strip() for p in first)
    assert [r["prompt"] for r in lines(out)] == first
    more = sp.sample_prompts(model, 9, out, seed=3, **KW)  # resumes after the last round, keeps what is there
    assert more[:6] == first and len(set(more)) == 9
    assert min(r["round"] for r in lines(out)[6:]) > max(r["round"] for r in lines(out)[:6])


def test_a_small_num_samples_only_the_rows_it_needs(model, sampled, tmp_path, monkeypatch):
    rows = []
    real = sp.generate
    monkeypatch.setattr(sp, "generate", lambda m, prompts, **kw: rows.append(len(prompts)) or real(m, prompts, **kw))
    few = sp.sample_prompts(model, 2, tmp_path / "few.jsonl", seed=3, max_new_tokens=48, batch_size=32, progress=False)
    assert rows == [8] and few == sampled[1][:2]  # the first rows of the same round: what a full batch would keep


def test_evaluation_prompts_are_never_kept(model, sampled, tmp_path, monkeypatch):
    first = sampled[1][:2]  # the first samples of seed 3, now declared evaluation prompts
    monkeypatch.setattr(sp, "evaluation_prompts", lambda: frozenset(normalise_prompt(p) for p in first))
    again = sp.sample_prompts(model, 2, tmp_path / "b.jsonl", seed=3, **KW)
    assert len(again) == 2 and not set(again) & set(first)


@pytest.mark.slow  # CI time: one error path
def test_a_model_that_never_finishes_a_request_is_a_clear_error(model, tmp_path, monkeypatch):
    monkeypatch.setattr(sp, "MAX_EMPTY_ROUNDS", 2)
    with pytest.raises(SpecformerError, match="no finished, new request"):
        sp.sample_prompts(model, 3, tmp_path / "p.jsonl", seed=0, max_new_tokens=1, batch_size=4, progress=False)


def test_greedy_sampling_is_refused(model, tmp_path):
    with pytest.raises(SpecformerError, match="temperature must be > 0"):
        sp.sample_prompts(model, 3, tmp_path / "p.jsonl", temperature=0.0, progress=False)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num", "0", "--out", "{tmp}/p.jsonl"], "positive integer"),
        (["--num", "3", "--out", "{tmp}/p.jsonl", "--temperature", "0"], "expected a positive finite number"),
        (["--num", "3", "--out", "{tmp}/p.jsonl", "--model", "{ckpt}"], "has no chat template"),
        (["--num", "3", "--out", "{tmp}/bad.jsonl"], "not a line written by sample-prompts"),
        (["--num", "3", "--out", "{tmp}"], "exists and is not a file"),
        (["--num", "3", "--out", "{tmp}/p.jsonl", "--system", " "], "system message is empty"),
        (["--num", "3", "--out", "{tmp}/p.jsonl", "--system", "", "--model", "{tmp}/none"], "system message is empty"),
    ],
)
def test_cli_bad_input(tiny_checkpoints, tmp_path, cli_error, args, message):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n')
    argv = ["sample-prompts", *(a.format(tmp=tmp_path, ckpt=tiny_checkpoints["llama3"]) for a in args)]
    assert message in cli_error(argv)


def test_new_prompts_keeps_only_requests_no_earlier_drafter_saw(tmp_path):
    """history/prompts/new_prompts.py, which picks each CPU data set's requests: a prompt of a
    committed set (case and spacing aside) and a repeat are dropped; a file with nothing new is one line and exit 2."""
    root = Path(__file__).resolve().parents[1]
    script = root / "history/prompts/new_prompts.py"
    with gzip.open(root / "history/prompts/self-prompts-9-tools.jsonl.gz", "rt") as f:
        seen = json.loads(f.readline())["prompt"]
    fresh = "Write a haiku about a kettle that only boils on Tuesdays, then explain the joke."
    sampled = tmp_path / "sampled.jsonl"
    sampled.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("  " + seen.upper(), fresh, fresh.lower())))
    out = tmp_path / "new.jsonl"
    run = subprocess.run([sys.executable, script, sampled, "--out", out], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "kept 1 of 3"
    assert lines(out) == [{"prompt": fresh}]
    sampled.write_text(json.dumps({"prompt": seen}) + "\n")
    out.unlink()
    run = subprocess.run([sys.executable, script, sampled, "--out", out], capture_output=True, text=True)
    assert run.returncode == 2 and not out.exists()
    assert run.stderr.strip() == "new_prompts.py: none of the 1 sampled prompts is new; nothing written"
