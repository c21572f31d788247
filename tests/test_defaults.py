"""The measured defaults (specformer_jax/defaults.py): each names where it was measured, the help texts and the
options' docstring are built from them (not copied), and the draft length decided for a call follows the tables,
with a kind they do not list drafting as on an accelerator."""

from __future__ import annotations

import dataclasses
import inspect
import types
from pathlib import Path

import jax
import pytest

from specformer_jax import defaults
from specformer_jax.cli import main
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.drafts.hybrid import Hybrid
from specformer_jax.decoding.drafts.ngram import NgramDrafts
from specformer_jax.decoding.options import DecodeOptions
from specformer_jax.decoding.tuning.draft_len import (
    decide_draft_len,
    default_budgeted_round,
    default_draft_len,
    hybrid_model_len,
)
from specformer_jax.modeling.loaded import LoadedDrafter

ROOT = Path(__file__).resolve().parents[1]
CPU = jax.default_backend() == "cpu"


def help_text(capsys, monkeypatch, command: str) -> str:
    """`specformer COMMAND --help` as printed, on one line per option (a wide terminal: no wrapping)."""
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


def option_help(text: str, option: str) -> str:
    """The option's entry in a help text: its line and the lines below it up to the next option."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(option))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("-") or not lines[i]), len(lines))
    return " ".join(lines[start:end])


def test_every_default_names_where_it_was_measured():
    names = {n for n in vars(defaults) if n.isupper() and not n.startswith("_") and n != "SOURCES"}
    assert set(defaults.SOURCES) == (names - {"CPU_DRAFT_LENS"}) | {f"CPU_DRAFT_LENS.{kind}"
                                                                    for kind in defaults.CPU_DRAFT_LENS}
    missing = [p for paths in defaults.SOURCES.values() for p in paths if not (ROOT / p).is_file()]
    assert not missing


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_the_draft_len_help_shows_the_tables(capsys, monkeypatch, command):
    shown = option_help(help_text(capsys, monkeypatch, command), "--draft-len")
    for kind, table in defaults.CPU_DRAFT_LENS.items():
        assert f"{kind} {defaults.pool_table_text(table)}" in shown
    assert f"({defaults.ACCELERATOR_NGRAM_DRAFTS} for ngram)" in shown
    monkeypatch.setattr(defaults, "CPU_DRAFT_LENS", {"specformer": {1: 5, range(2, 4): 1}, "ngram": {1: 9}})
    monkeypatch.setattr(defaults, "ACCELERATOR_NGRAM_DRAFTS", 6)
    shown = option_help(help_text(capsys, monkeypatch, command), "--draft-len")
    assert "specformer 5 at batch 1, 1 at batch 2-3; ngram 9 at batch 1," in shown and "(6 for ngram)" in shown
    assert "hybrid" not in shown


def test_the_chunk_rounds_help_shows_the_default(capsys, monkeypatch):
    for command in ("generate", "bench", "profile-round"):
        assert f"default {defaults.CHUNK_ROUNDS})" in option_help(help_text(capsys, monkeypatch, command),
                                                                  "--chunk-rounds")
    monkeypatch.setattr(defaults, "CHUNK_ROUNDS", 13)
    for command in ("generate", "bench", "profile-round"):
        assert "default 13)" in option_help(help_text(capsys, monkeypatch, command), "--chunk-rounds")


def test_the_options_docstring_states_the_defaults():
    doc = " ".join(inspect.getdoc(DecodeOptions).split())
    assert " ".join(defaults.draft_len_defaults_text().split()) in doc
    assert f"(None: {defaults.CHUNK_ROUNDS})" in doc and "DRAFT_LEN_DEFAULTS" not in doc


def loaded(slots: int) -> LoadedDrafter:
    return LoadedDrafter(DrafterConfig(num_slots=slots), None, {})  # the defaults read only its config


@dataclasses.dataclass(frozen=True)
class Lookup(NgramDrafts):
    """A kind of draft source the tables have never heard of."""


def test_a_kind_the_table_does_not_list_drafts_as_on_an_accelerator(monkeypatch):
    d = loaded(5)
    assert default_draft_len(Lookup(), 1, True) == defaults.ACCELERATOR_NGRAM_DRAFTS  # was a KeyError
    monkeypatch.setattr(defaults, "CPU_DRAFT_LENS", {"specformer": {1: 2}})
    assert default_draft_len(Hybrid(d), 1, True) == 5  # every slot of its SpecFormer drafter
    assert default_draft_len(NgramDrafts(), 1, True) == defaults.ACCELERATOR_NGRAM_DRAFTS
    assert default_draft_len(d, 1, True) == (2 if CPU else 5)  # a listed kind keeps its table
    assert default_draft_len(Lookup(), 1, False) == (1 if CPU else defaults.ACCELERATOR_NGRAM_DRAFTS)  # no kernels


def test_the_draft_len_decided_follows_the_tables(monkeypatch):
    monkeypatch.setattr(defaults, "CPU_DRAFT_LENS", {"specformer": {1: 1, range(2, 5): 2, 6: 9}, "hybrid": {3: 6}})
    monkeypatch.setattr(defaults, "HYBRID_CPU_MODEL_DRAFTS", {range(1, 4): 2})
    d = loaded(4)
    packed = types.SimpleNamespace(cfg=types.SimpleNamespace(pack_weights=True))  # a target with the CPU kernels
    decide = lambda k, drafter, pool: decide_draft_len(k, drafter, packed, pool, ids=[[1, 2]], max_new_tokens=8,
                                                       sampled=False, schedule="continuous", progress=False)
    want = [1, 2, 2, 2, 0, 4] if CPU else [4] * 6  # 9 at batch 6 is more than its 4 slots
    assert [decide(None, d, pool) for pool in range(1, 7)] == [(k, None) for k in want]
    assert [decide(None, Hybrid(d), pool)[0] for pool in (2, 3)] == ([0, 6] if CPU else [4, 4])
    assert decide(3, d, 5) == (3, None)  # the user's k, whatever the tables say
    # a hybrid's rounds with no n-gram row: the table's 2 for pools of 1-3, then the drafter alone's (at least 1)
    cfg = types.SimpleNamespace(pack_weights=True)
    assert [hybrid_model_len(Hybrid(d), pool, cfg) for pool in (1, 3, 4, 5)] == ([2, 2, 2, 1] if CPU else [4] * 4)
    assert hybrid_model_len(d, 1, cfg) is None


def test_the_default_budget_follows_its_table_and_never_exceeds_the_pools_drafts(monkeypatch):
    monkeypatch.setattr(defaults, "CPU_VERIFY_BUDGETS", {"specformer": {range(3, 5): (2, 8), range(6, 9): (3, 14)}})
    rounds = lambda drafter: [default_budgeted_round(drafter, pool, True) for pool in range(1, 10)]
    if not CPU:  # budgets are measured defaults of the CPU kernels only
        assert rounds(loaded(4)) == [None] * 9
        return
    assert rounds(loaded(4)) == [None, None, (2, 8), (2, 8), None, (3, 14), (3, 14), (3, 14), None]
    # a drafter of one slot drafts one a row, and a pool of 6 rows then fills 12 positions, not 14
    assert rounds(loaded(1)) == [None, None, (1, 6), (1, 8), None, (1, 12), (1, 14), (1, 14), None]
    assert default_budgeted_round(loaded(4), 4, False) is None  # no kernels: no budget
    assert default_budgeted_round(None, 4, True) is None
