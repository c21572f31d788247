"""The documented end-to-end path on a tiny target: specformer distill -> train -> eval-drafter, all through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specformer_jax.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_distill_train_eval_through_the_cli(tiny_checkpoints, tmp_path, capsys):
    model = str(tiny_checkpoints["llama3"])
    rng = np.random.default_rng(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": rng.integers(3, 128, 8).tolist()}) + "\n" for _ in range(48)))
    data, out = tmp_path / "data", tmp_path / "run"
    assert main(["distill", "--model", model, "--prompts", str(prompts), "--out", str(data), "--max-new-tokens", "24"]) == 0
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
    # a drafter for this target is rejected for another one
    err = main(["eval-drafter", "--model", str(tiny_checkpoints["qwen3"]), "--drafter", str(out / "drafter"),
                "--data", str(data)])
    assert err == 2 and "different target" in capsys.readouterr().err
