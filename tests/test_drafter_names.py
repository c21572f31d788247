"""Drafter strings (decoding/names.py): what each accepted one names; the CLI's commands and the Python API refuse
the same strings with the same line, the CLI before any model loads; accepted strings decode to the same tokens
through both."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from specformer_jax import resolve_drafter
from specformer_jax.assets import DEFAULT_DRAFTER, HISTORY_DRAFTERS
from specformer_jax.checkpoints.drafter_io import save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import main
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.ngram import NgramDrafts
from specformer_jax.decoding.names import read_drafter
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter

ROOT = Path(__file__).resolve().parents[1]
NAMES = "default, v14, a drafter directory, ngram, ngram:MIN-MAX, DRAFTER+ngram, random or none"
NGRAM_SYNTAX = "an n-gram drafter is 'ngram' or 'ngram:MIN-MAX' (e.g. ngram:2-5), got {!r}"
HYBRID_SYNTAX = ("a hybrid drafter is DRAFTER+ngram, DRAFTER one of default, v14, a drafter directory or random (e.g. "
                 "default+ngram), got {!r}")
RESTORE = ("drafter {0!r} is not shipped with the package (only v14 is): restore it with 'bash history/restore.sh {0}' "
           "and pass its directory, history/drafters/{0}")
REFUSED = {  # string -> the one line it is refused with
    "ngram:²-3": NGRAM_SYNTAX.format("ngram:²-3"),  # str.isdigit() took '²', int() did not: a traceback
    "ngram:1-²": NGRAM_SYNTAX.format("ngram:1-²"),
    "ngram:3": NGRAM_SYNTAX.format("ngram:3"),
    "default+ngram:x": NGRAM_SYNTAX.format("ngram:x"),
    "ngram:5-2": "min_n must be an integer in 1..max_n = 1..2, got 5",
    "ngram+ngram": HYBRID_SYNTAX.format("ngram+ngram"),  # was "drafter ngram does not exist"
    "none+ngram": HYBRID_SYNTAX.format("none+ngram"),
    "+ngram": HYBRID_SYNTAX.format("+ngram"),
    "default+ngram+ngram": HYBRID_SYNTAX.format("default+ngram+ngram"),
    "": f"the drafter is empty: give {NAMES}",  # was read as the current directory
    " ": f"the drafter is empty: give {NAMES}",
    "v12": RESTORE.format("v12"),
    "v4": RESTORE.format("v4"),
    "v5": RESTORE.format("v5"),
    "v13": f"drafter 'v13' does not exist: give {NAMES}",  # never a drafter
    "no/such/drafter+ngram": f"drafter 'no/such/drafter' does not exist: give {NAMES}",
}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


@pytest.fixture(scope="module")
def drafter_dir(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("drafter") / "d"
    cfg = DrafterConfig(num_slots=2)
    save_drafter(path, cfg, init_drafter(tiny.cfg, cfg, jax.random.key(0)), tiny.cfg, dtype="float32")
    return path


def test_accepted_strings_name_what_they_say(drafter_dir):
    accepted = {  # string -> (its SpecFormer drafter, its n-gram lookup)
        "default": ("default", None), "v14": (DEFAULT_DRAFTER, None), "random": ("random", None),
        "none": (None, None), "ngram": (None, NgramDrafts(max_n=4, min_n=1)),
        "ngram:2-5": (None, NgramDrafts(max_n=5, min_n=2)), "default+ngram:1-3": ("default", NgramDrafts(3, 1)),
        f"{drafter_dir}+ngram": (drafter_dir, NgramDrafts()), str(drafter_dir): (drafter_dir, None),
    }
    for text, (model, ngram) in accepted.items():
        name = read_drafter(text)
        assert (name.text, name.model, name.ngram) == (text, model, ngram), text
    assert read_drafter(drafter_dir).model == drafter_dir  # a Path is a directory
    assert read_drafter("none").none and not read_drafter("ngram").none


def test_default_means_random_weights_for_a_random_weight_target():
    """No drafter was trained for random weights: bench remapped "default" to "random" itself; now every caller."""
    model = load_target("random:tiny", dtype="float32")
    drafter = resolve_drafter("default+ngram", model)
    assert isinstance(drafter, Hybrid) and drafter.drafter.meta["random"] and drafter.ngram == NgramDrafts()
    assert read_drafter("default+ngram").on("random:tiny").text == "random+ngram"
    assert read_drafter("default").on("default").text == "default"


def test_the_history_names_are_the_restorable_ones():
    """The package cannot read history/drafters.tsv (it is not installed): its copy of the names must match."""
    rows = (ROOT / "history" / "drafters.tsv").read_text().splitlines()
    assert HISTORY_DRAFTERS == tuple(row.split("\t")[0] for row in rows if row and not row.startswith("#"))


@pytest.mark.parametrize("text", list(REFUSED))
def test_the_api_refuses_each_bad_string_in_one_line(tiny, text):
    for call in (lambda: resolve_drafter(text, tiny), lambda: generate(tiny, [[1, 5]], max_new_tokens=2,
                                                                         drafter=text)):
        with pytest.raises(SpecformerError) as refused:
            call()
        assert str(refused.value) == REFUSED[text]


def commands(text: str, tmp_path) -> list[list[str]]:
    """Every command taking a drafter string, with `text` as it (and a model that is not there: a command that
    loaded it first would say so instead)."""
    model = ["--model", str(tmp_path / "no-model")]
    runs = [["generate", *model, "--prompt", "hi", "--drafter", text],
            ["bench", *model, "--drafter", text, "--out", str(tmp_path / "b.json")],
            ["profile-round", *model, "--drafter", text, "--out", str(tmp_path / "p.json")],
            ["eval-drafter", *model, "--drafter", text, "--data", str(tmp_path)],
            ["draft-vocab", *model, "--drafter", text, "--data", str(tmp_path), "--size", "8", "--out",
             str(tmp_path / "dv")]]
    if text.strip():  # --drafters drops empty entries
        runs.append(["average-drafters", *model, "--drafters", f"default,{text}", "--out", str(tmp_path / "avg")])
    return runs


@pytest.mark.parametrize("text", list(REFUSED))
def test_the_cli_refuses_the_same_strings_with_the_same_line_before_loading(cli_error, tmp_path, text):
    for argv in commands(text, tmp_path):
        assert cli_error(argv) == f"specformer: error: {REFUSED[text]}", argv[0]


def test_commands_that_read_weights_refuse_other_drafters(cli_error, tmp_path):
    for text in ("ngram", "default+ngram", "none"):
        for argv in commands(text, tmp_path)[2:]:  # profile-round, eval-drafter, draft-vocab, average-drafters
            assert cli_error(argv) == (f"specformer: error: {argv[0]} takes a SpecFormer drafter (default, v14, a "
                                       f"drafter directory or random), got {text!r}")


def test_an_empty_model_is_refused(cli_error):
    """Path("") is the current directory: "--model ''" tried to load it."""
    assert cli_error(["generate", "--model", "", "--prompt", "hi"]) == (
        "specformer: error: model is empty: give a path or 'default'")


@pytest.mark.parametrize("model, text", [("llama3", "ngram:1-3"), ("llama3", "random+ngram"),
                                         pytest.param("random:tiny", "default", marks=pytest.mark.slow)])
def test_the_cli_and_the_api_decode_the_same(tiny_checkpoints, tmp_path, capsys, model, text):
    """The same tokens from `specformer generate --drafter TEXT` and `generate(model, ..., drafter=TEXT)`, and the
    drafter they decoded with ("default" with random weights: "random")."""
    path = str(tiny_checkpoints[model]) if model in tiny_checkpoints else model
    ids = [[1, 5, 9, 5, 9, 5], [1, 7, 3, 7]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ids))
    options = dict(max_new_tokens=6, batch_size=1, draft_len=2)
    argv = ["generate", "--model", path, "--prompts-file", str(prompts), "--json", "--drafter", text,
            *(f"--{k.replace('_', '-')}={v}" for k, v in options.items())]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    target = load_target(path)
    api = generate(target, ids, drafter=text, **options)
    assert [r["token_ids"] for r in doc["results"]] == api.token_ids
    assert doc["stats"]["drafter"] == ("random" if text == "default" else text)
    assert doc["stats"]["draft_len"] == api.stats["draft_len"] == 2
