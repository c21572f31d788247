"""The shipped drafter (v14) and the two shipped before it (v12, v4: restored from the repository's history by
history/restore.sh and loaded by path) decode exactly as they did when their files under `data/` were recorded: the
same tokens and the same stats (accepted lengths, per-slot acceptance, rounds); greedy speculative output equals the
plain output recorded there. And after decoding, the weights live once. v4's file was first recorded with the code of
commit 0f42673 (before the drafter became a typed value); rewritten when v4 shipped with its draft vocabulary (issue
34): the greedy case kept its tokens and stats, the sampled one draws its drafts from the vocabulary's distribution
and so samples other (equally distributed) tokens. v12's was recorded when it shipped as the default (issue 33), and
kept, renamed, when v14 replaced it; v14's when it shipped. All on the 2-core CPU machine.

A file is rewritten only by hand, for a change that is meant to alter drafting:
SPECFORMER_WRITE_EXPECTED=1 pytest tests/test_shipped_drafter.py (and say why in the commit)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
from pathlib import Path

import jax
import pytest

from specformer_jax.assets import DEFAULT_DRAFTER, SHIPPED_DRAFTERS
from specformer_jax.checkpoints.drafter_io import load_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.decoding.names import resolve_drafter
from specformer_jax.errors import SpecformerError
from specformer_jax.files import file_sha256

DATA = Path(__file__).parent / "data"
HISTORY = Path(__file__).resolve().parents[1] / "history"
EXPECTED = {"default": DATA / "shipped_drafter.json", "v12": DATA / "shipped_drafter_v12.json",
            "v4": DATA / "shipped_drafter_v4.json"}  # by drafter name (v12, v4: history/drafters/NAME)
PROMPTS = ["What is the capital of France?", "Write one sentence about why the sky is blue.",
           "Give me three tips for writing clear Python code."]
CASES = {  # name -> generate options (with the shipped drafter)
    "k4_batch1": dict(draft_len=4, batch_size=1),  # the fused decoding layout
    "k2_sampled_static": dict(draft_len=2, batch_size=3, schedule="static", temperature=0.8, top_p=0.95, seed=7),
}
STATS = ("mean_accepted_length", "acceptance_rate_per_slot", "rounds", "decode_steps", "per_row",
         "batch_accepted_length", "num_generated")
MAX_NEW = 40


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.fixture(scope="module")
def model():
    model = load_target("default")
    model.live_bytes_at_load = live_bytes()  # the weights in their stacked layout, and whatever else lives already
    return model


@pytest.fixture(scope="module")
def history_drafters() -> Path:
    """history/drafters, with v12 and v4 brought back from the commit history/drafters.tsv names (their sha256
    checked there); a clone without that history fails here, with restore.sh's line."""
    run = subprocess.run(["bash", str(HISTORY / "restore.sh"), "v12", "v4"], capture_output=True, text=True)
    if run.returncode:
        pytest.fail(f"bash history/restore.sh v12 v4: {(run.stderr or run.stdout).strip().splitlines()[-1]}")
    return HISTORY / "drafters"


# CI time: v12 and v4 (v4 of another shape: its own compiled programs) are checked with -m slow
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n != "default" else n
                                        for n in EXPECTED])
def decoded(model, request):
    """(the drafter's name, what it decoded in each case)."""
    name = request.param
    drafter = (resolve_drafter(name, model) if name == "default" else
               load_drafter(request.getfixturevalue("history_drafters") / name, model))
    out = {}
    for name, options in CASES.items():
        result = generate(model, PROMPTS, drafter=drafter, max_new_tokens=MAX_NEW, **options)
        out[name] = {"token_ids": result.token_ids, "stats": {k: result.stats[k] for k in STATS if k in result.stats}}
    if os.environ.get("SPECFORMER_WRITE_EXPECTED"):
        out["plain"] = {"token_ids": generate(model, PROMPTS, max_new_tokens=MAX_NEW, batch_size=3).token_ids}
        EXPECTED[request.param].write_text(json.dumps(out, indent=1) + "\n")
    return request.param, out


@pytest.mark.parametrize("name", list(CASES))
def test_the_shipped_drafter_decodes_as_before(decoded, name):
    drafter, runs = decoded
    expected = json.loads(EXPECTED[drafter].read_text())
    assert runs[name]["token_ids"] == expected[name]["token_ids"]
    assert runs[name]["stats"] == expected[name]["stats"]  # ratios of counts: exact through JSON
    if "temperature" not in CASES[name]:
        assert runs[name]["token_ids"] == expected["plain"]["token_ids"]  # lossless, greedy


def test_the_weights_live_once_after_decoding(model, decoded):
    """Decoding at batch 1 and at batch 3 converted the weights to both decoding layouts; the model holds one copy
    (modeling/loaded.py, use_decoding_layout) and nothing keeps another once generate returned. Before, a hidden
    cache kept two converted copies beside the loaded one: 3x the weights."""
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert weights > 500e6  # float32 SmolLM2-135M: 538 MB
    assert live_bytes() <= model.live_bytes_at_load + 16 * 2**20


def test_one_drafter_ships_and_the_earlier_ones_load_by_path(model, history_drafters, tmp_path, monkeypatch):
    """"default" is v14 (v12 averaged with two continuations of it, the same shape), the one drafter in the package.
    v12 and v4 shipped before it (v12 sees the emitted token at its slots and its context layer, v4 does not); they,
    and v5 to v11, are refused by name with the command that restores them and the path to give then; v13 never was
    a drafter; a directory that shares a name is given as ./NAME."""
    assert list(SHIPPED_DRAFTERS) == ["v14"]
    v14 = resolve_drafter("default", model)
    assert resolve_drafter("v14", model).sha256 == v14.sha256 == file_sha256(DEFAULT_DRAFTER / "params.safetensors")
    v4, v12 = (load_drafter(history_drafters / name, model) for name in ("v4", "v12"))
    assert not v4.cfg.next_token_input and not v4.cfg.context_token_input
    assert v12.cfg.next_token_input and v12.cfg.context_token_input and v14.cfg == v12.cfg
    assert len({v4.sha256, v12.sha256, v14.sha256}) == 3
    for gone in ("v4", "v5", "v10", "v11", "v12"):
        with pytest.raises(SpecformerError) as refused:
            resolve_drafter(gone, model)
        assert str(refused.value) == (f"drafter '{gone}' is not shipped with the package (only v14 is): restore it "
                                      f"with 'bash history/restore.sh {gone}' and pass its directory, "
                                      f"history/drafters/{gone}")
    assert history_drafters == HISTORY / "drafters"  # where the line says restore.sh puts them
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecformerError, match=r"^drafter 'v13' does not exist: give default, v14, a drafter directory"):
        resolve_drafter("v13", model)
    with pytest.raises(SpecformerError, match=r"^drafter './v14' does not exist"):
        resolve_drafter("./v14", model)
