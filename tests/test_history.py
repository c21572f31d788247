"""history/: the drafters that left the working tree come back from git history with the hash their table names, and
the shipped drafter is rebuilt from them bit for bit (rebuild.sh: the weight average of v12, s12 and s13)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HISTORY = ROOT / "history"


def table() -> dict[str, tuple[str, str, str]]:
    lines = (HISTORY / "drafters.tsv").read_text().splitlines()
    rows = [line.split("\t") for line in lines if not line.startswith("#")]
    return {name: (commit, path, sha) for name, commit, path, sha in rows}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, cwd=ROOT)


def test_every_drafter_in_the_table_is_in_git_history():
    """Each row's commit holds a drafter (drafter.json and params.safetensors) at its path, so restore.sh can bring
    it back; the hashes themselves are checked on restore (below, and in rebuild.sh)."""
    for name, (commit, path, sha) in table().items():
        files = subprocess.run(["git", "ls-tree", "--name-only", commit, f"{path}/"], capture_output=True, text=True,
                               cwd=ROOT, check=True).stdout.split()
        assert sorted(Path(f).name for f in files) == ["drafter.json", "params.safetensors"], name
        assert len(sha) == 64, name


def test_restore_refuses_an_unknown_name_in_one_line():
    out = run("history/restore.sh", "v99")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"restore.sh: no drafter 'v99' in history/drafters.tsv (known: {' '.join(table())})"]


def test_restore_brings_back_the_hash_the_table_names():
    out = run("history/restore.sh", "v4")
    assert out.returncode == 0, out.stderr
    params = (HISTORY / "drafters" / "v4" / "params.safetensors").read_bytes()
    assert hashlib.sha256(params).hexdigest() == table()["v4"][2]


@pytest.mark.slow
def test_rebuild_gives_the_shipped_drafter_bit_for_bit(tmp_path):
    out = subprocess.run(["bash", "history/rebuild.sh"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OUT": str(tmp_path / "v14")})
    assert out.returncode == 0, out.stderr[-2000:]
    shipped = ROOT / "specformer_jax/assets/drafter-smollm2-135m-instruct/params.safetensors"
    rebuilt = (tmp_path / "v14" / "params.safetensors").read_bytes()
    assert hashlib.sha256(rebuilt).digest() == hashlib.sha256(shipped.read_bytes()).digest()
    assert "the same drafter, bit for bit" in out.stdout
