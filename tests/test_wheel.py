"""The package as a user installs it: a wheel built from the checkout, installed into a fresh virtual environment,
runs the CLI on its own files (the benchmark prompts, the built-in prompts' word lists, the shipped drafter), with
nothing read from the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from specformer_jax.assets import DEFAULT_DRAFTER

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow  # CI time: a venv of its own; make demo installs the package
def test_a_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
    source = tmp_path / "source"  # the wheel is built from a copy, so the build leaves the checkout alone
    for package in ("specformer_jax", "pallas_kernels"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # built with the test environment's setuptools (a test dependency), so no package index is needed
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", tmp_path / "dist",
         source])
    (wheel,) = (tmp_path / "dist").glob("specformer_jax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for asset in ("eval-prompts.jsonl", "builtin-prompts.json", f"{DEFAULT_DRAFTER.name}/params.safetensors"):
        assert f"specformer_jax/assets/{asset}" in names
    # one drafter in the package: the shipped one (earlier ones are restored from the repository's history)
    shipped = f"specformer_jax/assets/{DEFAULT_DRAFTER.name}/drafter.json"
    assert [n for n in names if n.endswith("/drafter.json")] == [shipped]
    assert "pallas_kernels/cpu.cc" in names  # compiled on first use
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    # The dependencies come from the test environment's site-packages, added as a plain path: its .pth files (the
    # editable install of this checkout among them) are not read, so only the wheel provides specformer_jax.
    site = run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    Path(site.stdout.strip(), "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--quiet", wheel])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = run([venv / "bin" / "python", "-c", "import specformer_jax; print(specformer_jax.__file__)"],
                cwd=tmp_path, env=env)
    assert where.stdout.startswith(str(venv)), where.stdout
    cli = venv / "bin" / "specformer"
    assert "--draft-len" in run([cli, "generate", "--help"], cwd=tmp_path, env=env).stdout
    out = tmp_path / "distilled"
    distill = run([cli, "distill", "--builtin-prompts", "2", "--max-new-tokens", "4", "--batch-size", "2", "--out",
                   out], cwd=tmp_path, env=env)
    assert "2 prompts distilled" in distill.stderr and "could not be built" not in distill.stderr  # CPU kernels
    assert (out / "manifest.json").is_file() and (out / "shard-00000.jsonl").read_text().count("\n") == 2
