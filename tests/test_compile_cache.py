"""The CLI keeps XLA's compiled programs under SPECFORMER_CACHE/xla, so a second run skips compiling them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


@pytest.mark.slow  # three CLI runs of their own: kept out of `make test` for CI's time
def test_the_cli_keeps_compiled_programs(tiny_checkpoints, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 17, 3, 99]}) + "\n")
    exe = shutil.which("specformer", path=str(sys.prefix) + "/bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(SPECFORMER_CACHE=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cmd = [exe, "generate", "--model", str(tiny_checkpoints["llama3"]), "--prompts-file", str(prompts), "--json",
           "--max-new-tokens", "4"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    entries = set(os.listdir(tmp_path / "cache" / "xla"))
    assert any("cache" in e for e in entries)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env)
    tokens = lambda run: [r["token_ids"] for r in json.loads(run.stdout)["results"]]
    assert second.returncode == 0 and tokens(second) == tokens(first)
    assert set(os.listdir(tmp_path / "cache" / "xla")) == entries  # the same programs, read back, none new
    off = subprocess.run(cmd, capture_output=True, text=True,
                         env=dict(env, SPECFORMER_CACHE=str(tmp_path / "off"), JAX_ENABLE_COMPILATION_CACHE="false"))
    assert off.returncode == 0 and not (tmp_path / "off" / "xla").exists()
