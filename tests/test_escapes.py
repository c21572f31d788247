"""Bad inputs and faults a new user met that escaped the checks (issue 50): each now one line (exit 2 on the CLI,
SpecformerError in Python) or, for a fault, nothing lost."""

from __future__ import annotations

import errno
import itertools
import json
import types

import jax
import pytest

from specformer_jax.checkpoints.drafter_io import save_drafter
from specformer_jax.checkpoints.loader import load_target
from specformer_jax.cli import build_parser, main
from specformer_jax.config import DrafterConfig
from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling.drafter import init_drafter


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


def a_drafter(model, path):
    cfg = DrafterConfig(num_slots=2)
    save_drafter(path, cfg, init_drafter(model.cfg, cfg, jax.random.key(0)), model.cfg, dtype="float32")
    return path


def test_run_seconds_and_compile_seconds_add_up_to_the_whole_call(tiny_model, monkeypatch):
    """The run's clock started after the pool compiled, and that compilation was taken off the run again:
    `--max-new-tokens 8` printed "8 tokens in -0.03 s". On a clock that ticks once a reading, the run and its
    compilations (every one of them: a fresh compile cache) account for every tick between the first and last."""
    from specformer_jax.decoding.engine import runner, scheduler

    monkeypatch.setattr(runner, "COMPILED", runner.CompiledFunctions())  # the pool compiles inside this call
    ticks = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(scheduler, "time", clock)
    first = clock.perf_counter()
    s = generate(tiny_model, [[1, 5, 9], [1, 7]], max_new_tokens=8).stats
    last = clock.perf_counter()
    assert s["compile_seconds"] >= 3  # the pool, the prefill and a chunk, each compiled in this call
    assert s["run_seconds"] + s["compile_seconds"] == last - first - 2  # the two readings that bound the run
    monkeypatch.undo()
    s = generate(tiny_model, [[1, 5, 9], [1, 7]], max_new_tokens=8).stats  # on the real clock
    assert s["run_seconds"] > 0 and 0 < s["latency_seconds"]["p50"] <= s["run_seconds"]
    assert s["tokens_per_second"] == pytest.approx(s["num_generated"] / s["run_seconds"])


def test_bench_refuses_a_batch_size_whose_cache_cannot_fit(cli_error, tmp_path):
    """--batch-sizes 100000 decoded 100,000 requests for minutes without a word."""
    line = cli_error(["bench", "--model", "random:tiny", "--batch-sizes", "1,1000000000", "--out",
                      str(tmp_path / "b.json")])
    assert "batch size 1000000000 cannot run here: its KV cache alone takes" in line
    assert "(1,000,000,000 rows of" in line and "GiB are free on the host (room for" in line
    assert not (tmp_path / "b.json").exists()


def test_bench_says_what_will_run_before_running_it(tiny_model, monkeypatch, capsys):
    from specformer_jax.bench import run

    monkeypatch.setattr(run, "measure_device", lambda dtype: {})  # the device's rates: not what this is about
    run.run_benchmark(tiny_model, None, [[1, 5, 9]], batch_sizes=[1, 2], draft_len=None, max_new_tokens=2,
                      repeats=1, num_requests=3)
    first = capsys.readouterr().err.splitlines()[0]
    assert first == ("specformer bench: batch sizes 1 (3 requests), 2 (3 requests), up to 2 new tokens each; plain "
                     "decoding under continuous, each side 2 times (one untimed)")


def test_a_cache_that_takes_no_files_warns_and_keeps_the_answer(tiny_checkpoints, tiny_model, tmp_path, monkeypatch,
                                                                capsys):
    """Decoding reached 100%, then exited 2 naming a temporary file: the answer was lost for the records' sake."""
    monkeypatch.setenv("SPECFORMER_CACHE", "/proc/specformer-cache")  # the OS creates no file there
    drafter = a_drafter(tiny_model, tmp_path / "d")
    assert main(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompts-file", str(ids_file(tmp_path)),
                 "--drafter", str(drafter), "--draft-len", "2", "--max-new-tokens", "4", "--json"]) == 0
    out = capsys.readouterr()
    assert len(json.loads(out.out)["results"][0]["token_ids"]) == 4
    warnings = [line for line in out.err.splitlines() if "warning" in line]
    assert warnings == ["specformer: warning: cannot save decoding records to /proc/specformer-cache/"
                        "decode_records.json (No such file or directory): what --draft-len auto measures is kept for "
                        "this process only"]


def test_records_a_cache_refuses_are_kept_in_memory(tiny_model, tmp_path, capsys):
    """Else --draft-len auto would time the engines again at every call (bench: every repeat of a batch size)."""
    from specformer_jax.checkpoints.drafter_io import load_drafter
    from specformer_jax.decoding.tuning.records import DecodeRecords

    drafter = load_drafter(a_drafter(tiny_model, tmp_path / "d"), tiny_model)
    store = DecodeRecords("/proc/specformer-cache/decode_records.json")
    costs = [{"step_seconds": 0.5, "round_seconds": {1: 0.75}}, {"step_seconds": 0.25, "round_seconds": {1: 0.5}}]
    store.add_step_costs(tiny_model, drafter, 2, 64, costs[0])
    store.add_step_costs(tiny_model, drafter, 4, 64, costs[1])
    assert [store.step_costs(tiny_model, drafter, bs, 64) for bs in (2, 4)] == costs
    assert capsys.readouterr().err.count("warning") == 1


def test_a_read_only_cache_still_gives_the_gguf_tokenizer(tmp_path, monkeypatch):
    """The tokenizer converted from a GGUF is cached; a cache that takes no files keeps the tokenizer, not the error."""
    import transformers

    from specformer_jax.checkpoints import gguf_io

    class Tokenizer:
        def save_pretrained(self, directory):
            raise AssertionError("nowhere to save")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())
    monkeypatch.setenv("SPECFORMER_CACHE", "/proc/specformer-cache")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert isinstance(gguf_io._tokenizer(tmp_path / "m.gguf"), Tokenizer)


def test_a_rerun_save_removes_the_temporaries_a_killed_one_left(tiny_model, tmp_path):
    """average-drafters killed while saving left .params.safetensors.XXXX.tmp; the rerun's drafter sat beside it."""
    out = tmp_path / "avg"
    out.mkdir()
    (out / ".params.safetensors.q8z1w0ab.tmp").write_bytes(b"\0" * 64)
    (out / ".drafter.json.5hd2k9xe.tmp").write_text("{")
    a_drafter(tiny_model, out)
    assert sorted(p.name for p in out.iterdir()) == ["drafter.json", "params.safetensors"]


def test_train_on_a_full_disk_leaves_no_empty_files(tiny_checkpoints, tmp_path, monkeypatch):
    """It left a 0-byte train_config.json and metrics.jsonl; the error now names the file it could not write."""
    import os

    from specformer_jax.training import trainer
    from specformer_jax.training.train_config import TrainConfig

    records = [{"index": i, "input_ids": [(7 * i + j) % 120 + 3 for j in range(24)], "prompt_len": 8}
               for i in range(20)]
    monkeypatch.setattr(trainer, "load_records", lambda *a, **k: records)
    monkeypatch.setattr(trainer, "check_vocabulary", lambda *a: None)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    out = tmp_path / "run"
    cfg = TrainConfig.from_settings(dict(model=str(tiny_checkpoints["llama3"]), data="unused", out=str(out), seq_len=24,
                                         batch_size=4, num_slots=2, steps=2, eval_fraction=0.2))
    with pytest.raises(OSError) as e:
        trainer.train(cfg, progress=False)
    assert e.value.filename == str(out / "train_config.json") and e.value.errno == errno.ENOSPC
    assert not list(out.glob("*.json*")) and not list(out.glob(".*"))


def ids_file(tmp_path, ids=(1, 5, 9)):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": list(ids)}) + "\n")
    return path


def test_eval_drafter_save_checks_the_drafter_takes_files_then_prints_before_saving(tiny_checkpoints, tiny_model,
                                                                                   tmp_path, monkeypatch, capsys):
    """`eval-drafter --save` into a read-only drafter lost the result it had computed."""
    import os

    from specformer_jax import files
    from specformer_jax.training import evaluate
    from specformer_jax.training.data import dataset

    result = {"expected_accepted_length": 1.5, "accuracy_per_slot": [0.3, 0.2]}
    monkeypatch.setattr(evaluate, "evaluate_drafter", lambda *a, **k: result)  # the work that was lost
    monkeypatch.setattr(dataset, "check_vocabulary", lambda *a: None)
    monkeypatch.setattr(dataset, "records_to_score", lambda *a: [])
    drafter = a_drafter(tiny_model, tmp_path / "d")
    argv = ["eval-drafter", "--model", str(tmp_path / "no-model"), "--drafter", str(drafter), "--data", str(tmp_path),
            "--save"]

    def refused(dir, prefix):  # a read-only drafter directory: refused before the (here missing) model loads
        raise PermissionError(errno.EACCES, "Permission denied", f"{dir}/{prefix}x")

    monkeypatch.setattr(files, "tempfile", types.SimpleNamespace(mkstemp=refused))
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == (f"specformer: error: {drafter / 'drafter.json'}: cannot create a file "
                                               f"in {drafter} (Permission denied)")
    monkeypatch.undo()
    monkeypatch.setattr(evaluate, "evaluate_drafter", lambda *a, **k: result)
    monkeypatch.setattr(dataset, "check_vocabulary", lambda *a: None)
    monkeypatch.setattr(dataset, "records_to_score", lambda *a: [])

    def full_disk(fd):  # the disk filled while it evaluated
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full_disk)
    argv[2] = str(tiny_checkpoints["llama3"])
    assert main(argv) == 2
    out = capsys.readouterr()
    assert json.loads(out.out) == result
    assert out.err.strip() == (f"specformer: error: the result above was not saved ({drafter / 'drafter.json'}: "
                               "No space left on device)")


@pytest.mark.parametrize("value", ["-inf", "-nan", "-1e5", "-Infinity"])
def test_negative_numbers_reach_the_options_check(cli_error, value):
    """argparse read "-inf" as an option: "expected one argument"."""
    line = cli_error(["generate", "--prompt", "hi", "--temperature", value])
    assert f"argument --temperature: expected a non-negative finite number, got '{value}'" in line


@pytest.mark.parametrize("argv", [
    ["average-drafters", "--drafters", "a,b", "--out", "/proc/specformer-avg"],
    ["draft-vocab", "--drafter", "a", "--data", "d", "--size", "8", "--out", "/proc/specformer-dv"],
    ["train", "--set", "model=/nowhere/model", "data=/nowhere/data", "out=/proc/specformer-run"],
])
def test_output_directories_are_probed_before_the_model_loads(cli_error, argv):
    """Each failed only after a 6-8 s model load (the missing model here would fail first if it were loaded)."""
    line = cli_error(argv)
    assert "/proc/specformer-" in line and "cannot create a file in /proc" in line


def test_report_names_a_profile_round_file(cli_error, tmp_path):
    profile = tmp_path / "p.json"  # what `specformer profile-round` writes, cut to what tells it apart
    profile.write_text(json.dumps({"command": "specformer profile-round", "model": "default", "drafter": "default",
                                   "context": 72, "results": [{"batch_size": 1, "draft_len": 0, "whole_seconds": 0.01,
                                                               "parts_seconds": {"target": 0.008}}]}))
    line = cli_error(["report", str(profile), "--out", str(tmp_path / "r.md")])
    assert line == f"specformer: error: {profile} is a profile-round result; report reads specformer bench files"


@pytest.mark.parametrize("argv, option", [
    (["generate", "--prompt", "hi", "--max-new-token", "3"], "--max-new-token"),
    (["profile-round", "--draft-len", "2", "--out", "/tmp/never.json"], "--draft-len"),
])
def test_abbreviated_options_are_refused(cli_error, argv, option):
    assert f"unrecognized arguments: {option}" in cli_error(argv)


def test_no_parser_takes_abbreviations():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert not parser.allow_abbrev and not any(p.allow_abbrev for p in commands.values())


@pytest.mark.parametrize("hooks, message", [
    ("-1", "--hooks expects integers from 0 like 0,15,29,30, got '-1'"),  # was read as hook 30
    ("-1,5", "--hooks expects integers from 0 like 0,15,29,30, got '-1,5'"),  # was read as an option
    ("15,15", "--hooks lists 15 more than once"),
])
def test_cache_states_hooks_are_indices_from_zero_once_each(cli_error, tmp_path, hooks, message):
    assert message in cli_error(["cache-states", "--data", "d", "--out", str(tmp_path / "s"), "--hooks", hooks])


def test_a_data_directory_given_twice_is_refused(cli_error, tmp_path):
    """Its records were counted twice."""
    d = tmp_path / "d"
    line = cli_error(["cache-states", "--data", f"{d},{tmp_path}/x/../d", "--out", str(tmp_path / "s")])
    assert line == (f"specformer: error: --data names {tmp_path}/x/../d twice (also as {d}): its records would count "
                    "twice")
    from specformer_jax.training.data.dataset import load_records

    with pytest.raises(SpecformerError, match=f"^data names {d} twice: its records would count twice$"):
        load_records(f"{d},{d}")


def test_profile_round_refuses_a_context_past_the_models_positions(cli_error, tmp_path):
    """--context 9000 ran past the default model's 8,192 positions without a word (random:tiny has 1,024)."""
    line = cli_error(["profile-round", "--model", "random:tiny", "--context", "1000", "--draft-lens", "1,3",
                      "--batch-sizes", "1", "--out", str(tmp_path / "p.json")])
    assert line == ("specformer: error: context 1000 with a chunk of 8 rounds of up to 3 drafts reaches position "
                    "1032, past the model's 1024: give a context of at most 992")
