"""`specformer profile-round` (bench/round_profile.py) end to end on a tiny random model: every part of the plain
step and of each round is timed, the document holds what the tables and the done-when checks read, and bad input is
one line. No timing is asserted: speed is measured in benchmarks."""

from __future__ import annotations

import json

import pytest

from specformer_jax.bench.round_profile import ROUND_PARTS, STEP_PARTS, profile_rounds, render_markdown
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.decoding.names import resolve_drafter


@pytest.mark.slow  # CI time: the CLI test below profiles end to end in `make test`, on one batch size and k
def test_profile_document():
    model = load_target("random:tiny", dtype="float32")
    drafter = resolve_drafter("random", model)
    seen = []
    doc = profile_rounds(model, drafter, batch_sizes=[1, 2], draft_lens=[1, 3], context=20, chunk_rounds=2,
                         repeats=1, on_progress=lambda d: seen.append(d["complete"]), log=False)
    assert seen == [False, True] and doc["complete"] and all(r["layout"]["pack_weights"] for r in doc["results"])
    assert {r["layout"]["attention"] for r in doc["results"]} == {"cpu"}  # float32 on the CPU: the kernels
    rows = {(r["batch_size"], r["draft_len"]): r for r in doc["results"]}
    assert sorted(rows) == [(1, 0), (1, 1), (1, 3), (2, 0), (2, 1), (2, 3)]
    for (B, k), r in rows.items():
        assert set(r["parts_seconds"]) == set(ROUND_PARTS if k else STEP_PARTS)
        assert all(s > 0 for s in r["parts_seconds"].values()) and r["whole_seconds"] > 0
        assert r["parts_sum_seconds"] == pytest.approx(sum(r["parts_seconds"].values()))
        assert r["parts_over_whole"] == pytest.approx(r["parts_sum_seconds"] / r["whole_seconds"])
        step = rows[B, 0]["whole_seconds"]
        assert r["in_plain_steps"] == pytest.approx(r["whole_seconds"] / step)
        assert r["parts_in_plain_steps"]["target"] == pytest.approx(r["parts_seconds"]["target"] / step)
    table = render_markdown(doc)
    assert table.count("| part | plain step | k = 1 | k = 3 |") == 2 and "| **measured (chunk / R)** |" in table


def test_cli_writes_the_json_and_the_table(tmp_path):
    out, table = tmp_path / "profile.json", tmp_path / "profile.md"
    assert main(["profile-round", "--model", "random:tiny", "--dtype", "float32", "--batch-sizes", "1",
                 "--draft-lens", "2", "--context", "16", "--chunk-rounds", "2", "--repeats", "1", "--out", str(out),
                 "--table", str(table), "--budgets", "0,2"]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("specformer profile-round") and doc["drafter"] == "random" and doc["complete"]
    assert [r["draft_len"] for r in doc["results"]] == [0, 2]
    assert [(r["budget"], r["draft_len"]) for r in doc["budget_results"]] == [(1, 2), (3, 2)]  # batch 1 + 0, + 2
    step = doc["results"][0]["whole_seconds"]
    for r in doc["budget_results"]:
        assert r["whole_seconds"] > 0 and r["in_plain_steps"] == pytest.approx(r["whole_seconds"] / step)
        assert 0 < r["flat_target_seconds"] and r["flat_target_in_plain_steps"] > 0
    text = table.read_text()
    assert "| **sum of parts** |" in text and "| positions per round | round (chunk / R) | flat verify pass |" in text


@pytest.mark.parametrize("args,message", [
    (["--drafter", "none"], "profile-round takes a SpecFormer drafter"),
    (["--draft-lens", "9"], "--draft-lens must lie in 1..8"),
    (["--context", "0"], "--context"),
])
def test_bad_input_is_one_line(cli_error, tmp_path, args, message):
    err = cli_error(["profile-round", "--model", "random:tiny", *args, "--out", str(tmp_path / "p.json")])
    assert message in err
