"""The documented end-to-end path on a tiny target: specformer distill -> train -> eval-drafter, all through the CLI."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import jax
import numpy as np

from specformer_jax.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_distill_train_eval_through_the_cli(tiny_checkpoints, tmp_path, capsys):
    model = str(tiny_checkpoints["llama3"])
    rng = np.random.default_rng(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": rng.integers(3, 128, 8).tolist()}) + "\n" for _ in range(48)))
    data, out = tmp_path / "data", tmp_path / "run"
    assert main(["distill", "--model", model, "--prompts", str(prompts), "--out", str(data),
                 "--max-new-tokens", "24"]) == 0
    argv = ["train", "--config", str(CONFIGS / "drafter-tiny.yaml"), "--set", f"model={model}", "--set", f"data={data}",
            "--set", f"out={out}", "--set", "intermediate_size=48"]  # a SwiGLU narrower than the target's 128
    assert main(argv) == 0
    assert (out / "drafter" / "drafter.json").is_file() and (out / "metrics.jsonl").is_file()
    assert json.loads((out / "drafter" / "drafter.json").read_text())["drafter"]["intermediate_size"] == 48
    capsys.readouterr()
    assert main(["eval-drafter", "--model", model, "--drafter", str(out / "drafter"), "--data", str(data)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_slots"] == 3 and len(report["accuracy_per_slot"]) == 3
    assert report["num_sequences"] < 48  # held-out records only
    assert 1.0 <= report["expected_accepted_length"] <= 4.0
    # the first two slots, as decoding with two drafts: the same per-slot accuracy (slots are a prefix of all K)
    assert main(["eval-drafter", "--model", model, "--drafter", str(out / "drafter"), "--data", str(data),
                 "--draft-len", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["num_slots"] == 2 and two["accuracy_per_slot"] == report["accuracy_per_slot"][:2]
    assert 1.0 <= two["decoding_accepted_length"] <= 3.0
    # the trained drafter with a draft vocabulary of the 40 most frequent answer tokens: the same weights, lossless
    small = tmp_path / "small"
    assert main(["draft-vocab", "--model", model, "--drafter", str(out / "drafter"), "--data", str(data),
                 "--size", "40", "--eval-data", str(data), "--out", str(small)]) == 0
    _check_draft_vocab(model, data, out / "drafter", small)
    # a drafter for this target is rejected for another one
    err = main(["eval-drafter", "--model", str(tiny_checkpoints["qwen3"]), "--drafter", str(out / "drafter"),
                "--data", str(data)])
    assert err == 2 and "different target" in capsys.readouterr().err

    # bad input on the same data and run: one line each, never a traceback from orbax or JAX
    def error(argv):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err.strip().splitlines()[-1]

    assert "nothing to score" in error(["eval-drafter", "--model", model, "--drafter", str(out / "drafter"),
                                        "--data", str(data), "--seq-len", "2"])
    assert "draft_len must be" in error(["eval-drafter", "--model", model, "--drafter", str(out / "drafter"),
                                         "--data", str(data), "--draft-len", "4"])
    assert "drop --draft-len" in error(["eval-drafter", "--model", model, "--drafter", str(out / "drafter"),
                                        "--data", str(data), "--draft-len", "2", "--save"])
    dv = ["draft-vocab", "--model", model, "--drafter", str(out / "drafter"), "--data", str(data)]
    assert "already holds a drafter" in error([*dv, "--size", "40", "--out", str(small)])
    assert "must be smaller than the target's vocabulary" in error([*dv, "--size", "128", "--out", str(tmp_path / "x")])
    assert "no trained weights" in error([*dv[:-4], "--drafter", "random", "--data", str(data), "--size", "40",
                                          "--out", str(tmp_path / "x")])
    train = argv[:-2]  # the same run without its SwiGLU width
    assert "num_slots=3 (now 2)" in error([*train, "--set", "intermediate_size=48", "--set", "num_slots=2", "--resume"])
    other = tmp_path / "other-vocab"
    shutil.copytree(data, other)
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 49152}))
    assert "vocabulary of 49152 tokens" in error([*argv, "--set", f"data={other}", "--set", f"out={tmp_path / 'r2'}"])
    (other / "manifest.json").write_text(json.dumps(manifest))
    shard = other / "shard-00000.jsonl"
    lines = shard.read_text().splitlines()
    rec = json.loads(lines[0])
    shard.write_text("\n".join([json.dumps({**rec, "input_ids": rec["input_ids"][:-1] + [5000]}), *lines[1:]]) + "\n")
    assert "token id 5000 is outside" in error([*argv, "--set", f"data={other}", "--set", f"out={tmp_path / 'r3'}"])
    shard.write_text("not json\n" + "\n".join(lines[1:]) + "\n")
    assert "shard-00000.jsonl:1: not valid JSON" in error(["eval-drafter", "--model", model, "--drafter",
                                                           str(out / "drafter"), "--data", str(other)])
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    last = max((damaged / "checkpoints").iterdir(), key=lambda d: int(d.name) if d.name.isdigit() else -1)
    shutil.rmtree(last / "state")
    assert "could not restore checkpoint" in error([*argv, "--set", f"out={damaged}", "--resume"])
    # resuming with another model of the same shapes works, with a warning (a moved checkpoint is legitimate)
    assert main([*argv, "--set", f"model={tiny_checkpoints['qwen2']}", "--resume"]) == 0
    assert "was trained on model" in capsys.readouterr().err


def _check_draft_vocab(model: str, data: Path, full: Path, small: Path) -> None:
    """`small` is `full` with the 40 most frequent answer tokens of `data` (ties: the lower id) as its draft
    vocabulary, the same weights, and decodes the target's greedy tokens."""
    from specformer_jax.checkpoints.drafter_io import load_drafter
    from specformer_jax.checkpoints.loader import load_target
    from specformer_jax.decoding.api import generate
    from specformer_jax.training.data.dataset import read_distilled, split

    records = read_distilled(data)
    fraction = json.loads((full / "drafter.json").read_text())["train_config"]["eval_fraction"]
    kept = split(records, fraction)[0]  # the records its training used; the held-out ones choose nothing
    assert 0 < len(kept) < len(records)
    counts = collections.Counter(t for r in kept for t in r["input_ids"][r["prompt_len"]:])
    want = sorted(sorted(counts, key=lambda t: (-counts[t], t))[:40])
    target = load_target(model)
    a, b = load_drafter(full, target), load_drafter(small, target)
    assert b.cfg.draft_vocab_size == 40 and b.params.vocab.tolist() == want
    assert jax.tree.all(jax.tree.map(np.array_equal, a.params.weights, b.params.weights))
    meta = json.loads((small / "drafter.json").read_text())["draft_vocab"]
    assert meta["coverage_train"] == round(sum(counts[t] for t in want) / counts.total(), 4)
    every = collections.Counter(t for r in records for t in r["input_ids"][r["prompt_len"]:])
    assert meta["coverage_eval"] == round(sum(every[t] for t in want) / every.total(), 4)
    prompts = [r["input_ids"][:r["prompt_len"]] for r in records[:4]]
    assert (generate(target, prompts, max_new_tokens=12, drafter=b, draft_len=3).token_ids
            == generate(target, prompts, max_new_tokens=12).token_ids)
