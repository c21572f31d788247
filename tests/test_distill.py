"""`specformer distill`: shards equal greedy `generate`, resume is exact, settings are checked, prompts stay clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specformer_jax.assets import EVAL_PROMPTS as BENCHMARK
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError
from specformer_jax.training.data import distill as distill_mod
from specformer_jax.training.data import prompts as prompts_mod
from specformer_jax.training.data.dataset import read_distilled
from specformer_jax.training.data.distill import distill
from specformer_jax.training.data.prompts import builtin_prompts

# Ragged token-id prompts (the tiny checkpoints have no tokenizer). 6 prompts in shards of 2 = 3 shards.
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 23, 24, 25], [1, 3, 3], [1, 99, 42, 17, 8], [1, 64]]
KW = dict(max_new_tokens=8, batch_size=2, shard_size=2, progress=False)


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


def dir_contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_records_equal_greedy_generate(model, tmp_path):
    summary = distill(model, PROMPTS, tmp_path / "out", **KW)
    assert summary["shards_written"] == 3 and summary["shards_skipped"] == 0
    records = read_distilled(tmp_path / "out")
    ref = generate(model, PROMPTS, max_new_tokens=8, temperature=0.0, batch_size=2)
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    for rec, p, answer in zip(records, PROMPTS, ref.token_ids):
        assert rec["prompt_len"] == len(p)
        assert rec["input_ids"] == p + answer
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards_done"] == [0, 1, 2]
    assert manifest["num_prompts"] == 6 and manifest["vocab_size"] == 128 and manifest["max_new_tokens"] == 8
    # the manifest's fields are the on-disk format (specformer-distill-v1): earlier runs resume against them
    assert sorted(manifest) == ["chat", "complete", "dtype", "format", "max_new_tokens", "model", "num_prompts",
                                "num_shards", "prompts_sha256", "purpose", "shard_size", "shards_done", "vocab_size"]


def test_resume_after_interruption_gives_the_same_files(model, tmp_path, monkeypatch):
    distill(model, PROMPTS, tmp_path / "whole", **KW)

    calls = []

    def interrupted_generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(distill_mod, "generate", interrupted_generate)
    with pytest.raises(KeyboardInterrupt):
        distill(model, PROMPTS, tmp_path / "resumed", **KW)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["manifest.json", "shard-00000.jsonl"]
    with pytest.raises(SpecformerError, match="unfinished"):
        read_distilled(tmp_path / "resumed")
    assert len(read_distilled(tmp_path / "resumed", allow_partial=True)) == 2

    summary = distill(model, PROMPTS, tmp_path / "resumed", **KW)
    assert summary["shards_skipped"] == 1 and summary["shards_written"] == 2
    assert dir_contents(tmp_path / "resumed") == dir_contents(tmp_path / "whole")


def test_a_batch_larger_than_a_shard_decodes_several_shards_together(model, tmp_path, monkeypatch):
    distill(model, PROMPTS, tmp_path / "by_shard", **KW)
    sizes = []

    def counting_generate(model, prompts, **kwargs):
        sizes.append((len(prompts), kwargs["batch_size"]))
        return generate(model, prompts, **kwargs)

    monkeypatch.setattr(distill_mod, "generate", counting_generate)
    distill(model, PROMPTS, tmp_path / "batched", **{**KW, "batch_size": 4})
    assert sizes == [(4, 4), (2, 4)]  # shards 0-1 in one batch, then shard 2
    assert dir_contents(tmp_path / "batched") == dir_contents(tmp_path / "by_shard")


def test_finished_run_is_not_redone(model, tmp_path, monkeypatch):
    distill(model, PROMPTS, tmp_path / "out", **KW)
    monkeypatch.setattr(distill_mod, "generate", lambda *a, **k: pytest.fail("generate called for a finished run"))
    summary = distill(model, PROMPTS, tmp_path / "out", **{**KW, "batch_size": 3})  # batch size may change
    assert summary["shards_written"] == 0 and summary["shards_skipped"] == 3


@pytest.mark.parametrize(
    "change",
    [dict(max_new_tokens=4), dict(shard_size=3), dict(prompts=PROMPTS[:5]), dict(prompts=[[1, 2]] + PROMPTS[1:])],
)
def test_other_settings_into_an_existing_dir(model, tmp_path, change):
    distill(model, PROMPTS, tmp_path / "out", **KW)
    kwargs = {**KW, **change}
    prompts = kwargs.pop("prompts", PROMPTS)
    with pytest.raises(SpecformerError, match="pick a new --out"):
        distill(model, prompts, tmp_path / "out", **kwargs)


def test_non_empty_dir_without_manifest(model, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SpecformerError, match="no manifest.json"):
        distill(model, PROMPTS, tmp_path, **KW)


def test_evaluation_prompts_are_refused(model, tmp_path):
    # Checked before tokenizing, so it applies even to this tokenizer-less model; case and spacing do not matter.
    with pytest.raises(SpecformerError, match="evaluation prompt"):
        distill(model, [[1, 2], "what is the  capital of France?"], tmp_path / "out", **KW)


def test_data_for_evaluation_is_never_training_data(model, tmp_path):
    out = tmp_path / "eval"
    distill(model, PROMPTS, out, **KW, purpose="eval")
    assert len(read_distilled(out)) == len(PROMPTS)  # for measuring drafters
    with pytest.raises(SpecformerError, match="--for-eval"):
        read_distilled(out, for_training=True)
    with pytest.raises(SpecformerError, match="purpose: 'eval' there"):
        distill(model, PROMPTS, out, **KW)  # no resuming it as training data either
    # Evaluation prompts pass the check (this tokenizer-less model then stops at encoding them).
    with pytest.raises(SpecformerError, match="has no tokenizer"):
        distill(model, ["What is the capital of France?"], tmp_path / "e2", **KW, purpose="eval")


def benchmark_prompts() -> set[str]:
    return {json.loads(line)["prompt"] for line in BENCHMARK.read_text().splitlines() if line.strip()}


def test_builtin_prompts_are_deterministic_unique_and_clean():
    prompts = builtin_prompts(2000, seed=0)
    assert prompts == builtin_prompts(2000, seed=0)
    assert len(set(prompts)) == 2000
    assert builtin_prompts(100, seed=0) == prompts[:100]
    assert builtin_prompts(100, seed=1) != prompts[:100]
    evaluation = {p.casefold() for p in benchmark_prompts()}
    assert evaluation and not {p.casefold() for p in prompts} & evaluation
    # Several kinds of request, not one template.
    for marker in ["```python", "Show your working.", "SQL query", "JavaScript function", "poem", "email", "recipe"]:
        assert any(marker in p for p in prompts), marker


def test_builtin_prompts_skip_evaluation_prompts(tmp_path, monkeypatch):
    first = builtin_prompts(11, seed=0)
    monkeypatch.setattr(prompts_mod, "evaluation_prompts", lambda: frozenset([prompts_mod.normalise_prompt(first[3])]))
    assert builtin_prompts(10, seed=0) == first[:3] + first[4:]


def test_cli_distill(tiny_checkpoints, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    argv = ["distill", "--model", str(tiny_checkpoints["llama3"]), "--prompts", str(prompts),
            "--out", str(tmp_path / "out"), "--max-new-tokens", "8", "--batch-size", "2"]
    assert main(argv) == 0
    assert "6 prompts distilled" in capsys.readouterr().err.splitlines()[-1]
    assert [r["input_ids"][: r["prompt_len"]] for r in read_distilled(tmp_path / "out")] == PROMPTS




def test_cli_distill_builtin_and_file_prompts_together(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_mod, "builtin_prompts", lambda n, seed: [[1, 100 + i] for i in range(n)])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    argv = ["distill", "--model", str(tiny_checkpoints["llama3"]), "--prompts", str(prompts), "--builtin-prompts", "3",
            "--out", str(tmp_path / "out"), "--max-new-tokens", "4", "--batch-size", "2"]
    assert main(argv) == 0
    assert [r["input_ids"][: r["prompt_len"]] for r in read_distilled(tmp_path / "out")] == [
        [1, 100], [1, 101], [1, 102], *PROMPTS]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "{tmp}/missing.jsonl", "--out", "{tmp}/out"], "does not exist"),
        (["--prompts", "{tmp}/missing.jsonl"], "--out"),
        (["--out", "{tmp}/out"], "give --prompts F.jsonl, --builtin-prompts N, or both"),
        (["--builtin-prompts", "0", "--out", "{tmp}/out"], "positive integer"),
        (["--builtin-prompts", "5", "--out", "{tmp}/out", "--model", "{ckpt}"], "has no tokenizer"),
    ],
)
def test_cli_bad_input(tiny_checkpoints, tmp_path, cli_error, args, message):
    argv = ["distill", *(a.format(tmp=tmp_path, ckpt=tiny_checkpoints["llama3"]) for a in args)]
    assert message in cli_error(argv)
