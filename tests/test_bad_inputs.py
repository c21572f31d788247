"""Bad input gives one clear error line and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specformer_jax.checkpoints.loader import load_target
from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(cli_error, tmp_path):
    line = cli_error(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert "does not exist" in line


def test_directory_without_config(cli_error, tmp_path):
    line = cli_error(["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert "no config.json" in line


def test_unsupported_model_type(cli_error, tmp_path, tiny_checkpoints):
    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert "unsupported model_type 'gpt2'" in line


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(cli_error, tmp_path, tiny_checkpoints, damage):
    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\x00garbage" * 64 if damage == "garbage" else data[: len(data) // 2])
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert "corrupt safetensors" in line


def test_config_that_does_not_match_weights(cli_error, tmp_path, tiny_checkpoints):
    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    line = cli_error(["generate", "--model", str(d), "--prompt", "hi"])
    assert "config implies" in line


def test_corrupt_gguf(cli_error, tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\xff" * 100)
    line = cli_error(["generate", "--model", str(f), "--prompt", "hi"])
    assert "cannot read GGUF" in line


def test_gguf_with_impossible_metadata(cli_error, tmp_path):
    import gguf

    f = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    for key, value in [("embedding_length", 64), ("attention.head_count", 0), ("feed_forward_length", 128),
                       ("block_count", 2), ("vocab_size", 128)]:
        w.add_uint32(f"llama.{key}", value)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    line = cli_error(["generate", "--model", str(f), "--prompt", "hi"])
    assert f"GGUF file {f}: num_attention_heads must be a positive integer, got 0" in line


def test_prompt_longer_than_cache(cli_error, tmp_path, tiny_checkpoints):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(3, 40))}) + "\n")
    argv = ["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompts-file", str(prompts),
            "--max-cache-len", "32"]
    line = cli_error(argv)
    assert "prompt 0 has 37 tokens" in line and "cache holds 32" in line


def test_text_prompt_without_tokenizer(cli_error, tiny_checkpoints):
    line = cli_error(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompt", "hello"])
    assert "has no tokenizer" in line


def test_token_id_outside_vocabulary(cli_error, tmp_path, tiny_checkpoints):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [1, 5000]}) + "\n")
    line = cli_error(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompts-file", str(prompts)])
    assert "outside the vocabulary" in line


@pytest.mark.parametrize("content", ['{"prompt": 3}\n', "not json\n", "",
                                     '{"prompt": "hi", "input_ids": [1, 5]}\n'])  # both: one was dropped silently
def test_bad_prompts_file(cli_error, tmp_path, content):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    line = cli_error(["generate", "--prompts-file", str(prompts)])
    assert str(prompts) in line


@pytest.mark.parametrize(
    "option",
    [["--temperature", "-1"], ["--temperature", "hot"], ["--top-p", "1.5"], ["--top-k", "-3"],
     ["--max-new-tokens", "0"], ["--batch-size", "x"], ["--dtype", "float16"], ["--bogus"]],
)
def test_bad_option_values(cli_error, option):
    line = cli_error(["generate", "--prompt", "hi", *option])
    assert "specformer" in line


def test_no_prompts(cli_error):
    assert "no prompts" in cli_error(["generate"])


def test_empty_batch_in_api(tiny_checkpoints):
    model = load_target(tiny_checkpoints["llama3"])
    with pytest.raises(SpecformerError, match="no prompts"):
        generate(model, [])


def test_console_script_exit_code(tmp_path):
    exe = shutil.which("specformer", path=str(sys.prefix) + "/bin")
    proc = subprocess.run([exe, "generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("specformer: error:")
    assert "Traceback" not in proc.stderr


def test_prompts_file_that_is_a_directory_or_not_text(cli_error, tmp_path):
    assert "is a directory" in cli_error(["generate", "--prompts-file", str(tmp_path)])
    binary = tmp_path / "p.jsonl"
    binary.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    assert "not UTF-8 text" in cli_error(["generate", "--prompts-file", str(binary)])


def test_seed_that_does_not_fit(cli_error):
    assert "fits in 64 bits" in cli_error(["generate", "--prompt", "hi", "--seed", str(10**24)])


def test_draft_len_without_a_drafter(cli_error, tiny_checkpoints):
    line = cli_error(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompt", "1", "--draft-len", "3"])
    assert "needs a drafter" in line


def test_outputs_that_cannot_be_written(cli_error, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    line = cli_error(["distill", "--builtin-prompts", "1", "--out", str(a_file)])
    assert "exists and is not a directory" in line
    assert "which is a file" in cli_error(["sample-prompts", "--num", "1", "--out", str(a_file / "x.jsonl")])


def test_cache_directory_that_is_a_file(cli_error, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path / "f"))
    (tmp_path / "f").write_text("")
    assert "is a file" in cli_error(["generate", "--prompt", "hi"])


def test_os_errors_are_one_line(cli_error, tmp_path, monkeypatch):
    from specformer_jax.cli import decode

    def refused(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "out"))

    monkeypatch.setattr(decode, "run_generate", refused)
    assert cli_error(["generate", "--prompt", "hi"]).endswith("out: Permission denied")


def test_cache_past_the_context_length_warns(tiny_checkpoints, tmp_path, capsys):
    from specformer_jax.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 5, 9]}\n')
    assert main(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompts-file", str(prompts),
                 "--max-new-tokens", "2", "--max-cache-len", "300"]) == 0  # the tiny model's context is 256
    assert "past the model's context length (256)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_target(tiny_checkpoints["llama3"])


@pytest.mark.parametrize("prompts, kwargs, message", [
    ("Hi", {}, "wrap a single prompt"),  # was split into one prompt per character
    ([1, 5, 6], {}, "wrap a single prompt"),
    ([[1.0, 5.7]], {}, "prompt 0 must be text or a list of integer token ids"),  # was truncated to [1, 5]
    ([[True, False]], {}, "prompt 0 must be text"),
    ([[1, 5]], {"max_new_tokens": 2.5}, "max_new_tokens must be a positive integer"),
    ([[1, 5]], {"batch_size": "2"}, "batch_size must be a positive integer"),
    ([[1, 5]], {"seed": 2**70}, "seed must be an integer that fits in 64 bits"),
    ([[1, 5]], {"temperature": None}, "temperature must be a non-negative finite number"),
    ([[1, 5]], {"temperature": 1.0, "top_k": 2.5}, "top_k must be a non-negative integer"),
    ([[1, 5]], {"draft_len": 2}, "needs a drafter"),
    ([[1, 5]], {"drafter": 3}, r"drafter must be a loaded drafter \(what resolve_drafter\(name, model\)"),
    ([[1, 5]], {"drafter": "default"}, "was made for a different target"),  # v14, for SmolLM2
    ([[1, 5]], {"mesh": "bogus"}, "mesh"),
    ({"prompt": "Hi"}, {}, "wrap a single prompt"),  # decoded the key "prompt"
    ({"Hi", "Bye"}, {}, "got a set: its order is arbitrary"),  # results came in arbitrary order
    ([[1, 5]], {"chunk_rounds": 10**9}, r"chunk_rounds must be an integer in 1..max_new_tokens = 1..2"),  # never ended
    ([[1, 5]], {"max_cache_len": "abc"}, r"max_cache_len must be a positive integer or None \(the model's context "
     r"length\), got 'abc'"),  # a TypeError
    ([[1, 5]], {"max_cache_len": 0}, "max_cache_len must be a positive integer or None"),  # the context length
    ([[1, 5]], {"max_cache_len": 100.5}, "max_cache_len must be a positive integer or None"),  # accepted
    ([[1, 5]], {"chat": "False"}, "chat must be True or False, got 'False'"),  # read as true
    ([[1, 5]], {"progress": "no"}, "progress must be True or False, got 'no'"),
    ([[1, 5]], {"options": {"max_new_tokens": 2}}, "options must be a DecodeOptions, got dict"),
])
def test_generate_refuses_misused_arguments(tiny_model, prompts, kwargs, message):
    with pytest.raises(SpecformerError, match=message):
        generate(tiny_model, prompts, max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)


def test_generate_takes_id_arrays_and_a_mesh_spec(tiny_model):
    import numpy as np

    arrays = generate(tiny_model, np.array([[1, 5, 6], [1, 7, 8]]), max_new_tokens=3, mesh="data=1").token_ids
    assert arrays == generate(tiny_model, [[1, 5, 6], [1, 7, 8]], max_new_tokens=3).token_ids


def test_a_drafter_for_another_target_is_refused_before_decoding(tiny_model, tiny_checkpoints):
    import jax

    from specformer_jax.config import DrafterConfig
    from specformer_jax.modeling.drafter import init_drafter
    from specformer_jax.modeling.loaded import LoadedDrafter, target_fingerprint

    other = load_target(tiny_checkpoints["qwen3"]).cfg  # head_dim 32 against 16
    params = init_drafter(other, DrafterConfig(num_slots=2), jax.random.key(0))
    with pytest.raises(SpecformerError, match="made for a different target"):
        generate(tiny_model, [[1, 5]], drafter=LoadedDrafter(DrafterConfig(num_slots=2), params,
                                                             {"target": target_fingerprint(other)}))
    with pytest.raises(SpecformerError, match="does not fit the model"):  # no record of its target: shapes tell
        generate(tiny_model, [[1, 5]], drafter=LoadedDrafter(DrafterConfig(num_slots=2), params, {}))


def test_distill_checks_its_arguments_before_writing(tiny_model, tmp_path):
    from specformer_jax.training.data.distill import distill

    with pytest.raises(SpecformerError, match="max_new_tokens must be a positive integer"):
        distill(tiny_model, [[1, 5]], tmp_path / "d", max_new_tokens=0, progress=False)
    assert not (tmp_path / "d").exists()  # a rerun with a good value is not refused as "other settings"


def test_a_prompt_with_a_lone_surrogate(cli_error, tmp_path, tiny_checkpoints):
    """JSON can spell a lone surrogate ("\\ud800"); no tokenizer takes it (a TypeError deep in tokenizers)."""
    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    save_a_tokenizer(d)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "x \\ud800 y"}\n')
    line = cli_error(["generate", "--model", str(d), "--prompts-file", str(prompts)])
    assert "prompt 1 is not valid Unicode text: character 2 is a lone surrogate ('\\ud800')" in line
    with pytest.raises(SpecformerError, match="prompt 0 is not valid Unicode text"):
        generate(load_target(d), ["x \udcff"], max_new_tokens=2)


def save_a_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<eos>": 2, "hi": 3, "there": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(directory)


@pytest.mark.parametrize("name, damage, message", [
    ("tokenizer.json", lambda t: t[: len(t) // 2], "tokenizer.json is not valid JSON"),
    ("tokenizer_config.json", lambda t: "{,}", "tokenizer_config.json is not valid JSON"),
    ("tokenizer.json", lambda t: '{"model": 7}', "cannot build a tokenizer from"),
])
def test_damaged_tokenizer_files(cli_error, tmp_path, tiny_checkpoints, name, damage, message):
    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    save_a_tokenizer(d)
    assert load_target(d).tokenizer.encode("hi there", add_special_tokens=False) == [3, 4]  # sound, it loads
    (d / name).write_text(damage((d / name).read_text()))
    assert message in cli_error(["generate", "--model", str(d), "--prompt", "hi"])


def test_binary_files_where_text_is_read(cli_error, tmp_path):
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    assert f"{binary} is not UTF-8 text" in cli_error(["report", str(binary), "--out", str(tmp_path / "r.md")])
    assert f"{binary} is not UTF-8 text" in cli_error(["sample-prompts", "--num", "2", "--out", str(binary)])
    assert f"{binary} is not UTF-8 text" in cli_error(["train", "--config", str(binary)])


def test_models_and_drafters_that_are_not_paths(tiny_model):
    from specformer_jax.checkpoints.drafter_io import load_drafter

    with pytest.raises(SpecformerError, match="model must be a path or 'default', got 123"):
        load_target(123)
    with pytest.raises(SpecformerError, match="drafter must be a drafter directory, got None"):
        load_drafter(None, tiny_model)
    with pytest.raises(SpecformerError, match="model is empty: give a path or 'default'"):
        load_target("")  # was read as the current directory


@pytest.mark.parametrize("model", ["default", None])
def test_a_path_where_a_loaded_model_goes_is_one_line(model, tmp_path):
    """Each raised a raw AttributeError: the functions take what load_target returns."""
    from specformer_jax.checkpoints.drafter_io import load_drafter
    from specformer_jax.decoding.api import generate_stream
    from specformer_jax.decoding.names import resolve_drafter
    from specformer_jax.training.data.distill import distill
    from specformer_jax.training.evaluate import evaluate_drafter

    expected = r"must be a loaded target \(what load_target\(path\) returns\), got"
    for call in (lambda: generate(model, [[1, 5]]), lambda: generate_stream(model, [[1, 5]]),
                 lambda: load_drafter("default", model), lambda: resolve_drafter("default", model),
                 lambda: distill(model, [[1, 5]], tmp_path / "d"),
                 lambda: evaluate_drafter(model, None, [{"input_ids": [1, 5]}])):
        with pytest.raises(SpecformerError, match=expected):
            call()


def test_unknown_keywords_name_the_public_function(tiny_model):
    from specformer_jax.decoding.api import generate_stream

    with pytest.raises(TypeError, match=r"^generate\(\) got an unexpected keyword argument 'max_tokens'"):
        generate(tiny_model, [[1, 5]], max_tokens=4)
    with pytest.raises(TypeError, match=r"^generate_stream\(\) got an unexpected keyword argument 'max_tokens'"):
        generate_stream(tiny_model, [[1, 5]], max_tokens=4)


def test_more_builtin_prompts_than_the_lists_make_is_refused_before_any_work(cli_error, tmp_path):
    """It generated prompts for ~460 s before saying so."""
    from specformer_jax.training.data.prompts import builtin_capacity

    line = cli_error(["distill", "--builtin-prompts", "100000000", "--out", str(tmp_path / "d")])
    assert f"cannot make 100,000,000 distinct built-in prompts: the built-in lists make {builtin_capacity():,}" in line


def test_a_list_option_that_repeats_a_value(cli_error, tmp_path):
    line = cli_error(["bench", "--batch-sizes", "2,2", "--out", str(tmp_path / "r.json")])  # two rows for batch 2
    assert "--batch-sizes lists 2 more than once" in line


def test_chunk_rounds_past_the_budget_on_the_command_line(cli_error, tiny_checkpoints):
    line = cli_error(["generate", "--model", str(tiny_checkpoints["llama3"]), "--prompt", "hi", "--no-chat",
                      "--max-new-tokens", "4", "--chunk-rounds", "1000000000"])
    assert "chunk_rounds must be an integer in 1..max_new_tokens = 1..4" in line


def test_outputs_the_os_cannot_create_are_refused_before_the_model_loads(cli_error, tmp_path):
    """/proc takes no new files: probed by creating one, before the (here missing) model would load."""
    missing = str(tmp_path / "no-model")
    for argv in (["bench", "--model", missing, "--out", "/proc/b.json"],
                 ["bench", "--model", missing, "--out", str(tmp_path / "b.json"), "--plot", "/proc/b.png"],
                 ["distill", "--model", missing, "--builtin-prompts", "1", "--out", "/proc/specformer-d"],
                 ["report", str(tmp_path / "r.json"), "--out", "/proc/r.md"]):
        line = cli_error(argv)
        assert "/proc/" in line and "cannot create a file in /proc" in line, line
    assert not (tmp_path / "b.json").exists()
    # a device where a file goes would be replaced by a regular file (atomic writes rename over the target)
    assert "/dev/null exists and is not a file" in cli_error(["report", str(tmp_path / "r.json"), "--out", "/dev/null"])


@pytest.mark.parametrize("where", ["embedding row", "one layer"])
def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(cli_error, tmp_path, tiny_checkpoints, where):
    """One NaN in one embedding row used to decode that row as [0, 0, 0, ...] with exit 0."""
    from safetensors.numpy import load_file, save_file

    d = copy_checkpoint(tiny_checkpoints["llama3"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.embed_tokens.weight" if where == "embedding row" else "model.layers.1.mlp.down_proj.weight"
    tensors[name][5, 3] = np.nan if where == "embedding row" else np.inf
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    assert f"{d}: tensor {name} holds NaN or infinite values" in cli_error(
        ["generate", "--model", str(d), "--prompts-file", str(write_ids(tmp_path, [1, 5, 9]))])


def test_a_drafter_with_nan_weights_is_refused(tiny_model, tmp_path):
    import jax

    from specformer_jax.checkpoints.drafter_io import load_drafter, save_drafter
    from specformer_jax.config import DrafterConfig
    from specformer_jax.modeling.drafter import init_drafter

    cfg = DrafterConfig(num_slots=2)
    params = init_drafter(tiny_model.cfg, cfg, jax.random.key(0))
    params.weights["expand"]["bias"] = params.weights["expand"]["bias"].at[7].set(np.nan)
    save_drafter(tmp_path / "d", cfg, params, tiny_model.cfg, dtype="float32")
    with pytest.raises(SpecformerError, match=r"params.safetensors: tensor expand/bias holds NaN or infinite values"):
        load_drafter(tmp_path / "d", tiny_model)


def write_ids(tmp_path, ids):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": ids}) + "\n")
    return path


def test_tensors_of_gguf_files_are_named_as_the_file_names_them():
    """A NaN in a GGUF file is reported under the file's own tensor name (blk.N.attn_q.weight, ...)."""
    from specformer_jax.checkpoints.gguf_io import _GLOBAL_NAMES, _LAYER_NAMES, _hf_name, gguf_name

    names = list(_GLOBAL_NAMES) + [f"blk.7.{name}" for name in _LAYER_NAMES]
    assert [gguf_name(_hf_name(n)) for n in names] == names
