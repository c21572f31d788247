"""Atomic writes: an interrupted write leaves the previous file whole and no temporary file behind; a full disk
leaves no empty or cut file, and its error names the file."""

import errno
import json
import os
import types

import numpy as np
import pytest

from specformer_jax import files
from specformer_jax.checkpoints import safetensors_io
from specformer_jax.files import atomic_open, write_json


def test_an_interrupted_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"a": 1})
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path) as f:
            f.write('{"a": ')
            raise KeyboardInterrupt
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]


def test_written_files_get_the_usual_permissions_not_mkstemps_private_ones(tmp_path):
    umask = os.umask(0o022)
    try:
        write_json(tmp_path / "new.json", {})
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o644
        (tmp_path / "old.json").write_text("{}")
        os.chmod(tmp_path / "old.json", 0o640)
        write_json(tmp_path / "old.json", {"a": 1})  # an existing file keeps its own
        assert (tmp_path / "old.json").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(umask)


def test_safetensors_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "params.safetensors"
    old = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    safetensors_io.write_safetensors(path, old)
    np.testing.assert_array_equal(safetensors_io.read_safetensors(path)["w"], old["w"])

    def fail(*_):
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors_io, "struct", types.SimpleNamespace(pack=fail, unpack=None))
    with pytest.raises(OSError, match="No space"):
        safetensors_io.write_safetensors(path, {"w": np.zeros((4, 4), np.float32)})
    monkeypatch.undo()
    np.testing.assert_array_equal(safetensors_io.read_safetensors(path)["w"], old["w"])
    assert os.listdir(tmp_path) == ["params.safetensors"]


def full_disk(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_write_on_a_full_disk_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    """`train` on a full disk left a 0-byte train_config.json, and the error named a temporary file."""
    monkeypatch.setattr(os, "fsync", full_disk)  # where a full disk shows at the latest
    with pytest.raises(OSError) as e:
        write_json(tmp_path / "train_config.json", {"steps": 1})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "train_config.json")
    assert os.listdir(tmp_path) == []


class HalfWritten:
    """A file on a disk that fills halfway through a write."""

    def __init__(self, path, mode):
        self.file = open(path, mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def write(self, text):
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        full_disk()


def test_a_line_appended_on_a_full_disk_leaves_the_log_as_it_was(tmp_path, monkeypatch):
    """An empty metrics.jsonl was left where nothing could be logged, and a cut line would break every reader."""
    log = tmp_path / "metrics.jsonl"
    monkeypatch.setattr(files, "open", HalfWritten, raising=False)
    with pytest.raises(OSError) as e:
        files.append_line(log, '{"step": 1}')
    assert e.value.filename == str(log) and e.value.strerror == os.strerror(errno.ENOSPC)
    assert not log.exists()
    monkeypatch.undo()
    files.append_line(log, '{"step": 1}')
    monkeypatch.setattr(files, "open", HalfWritten, raising=False)
    with pytest.raises(OSError):
        files.append_line(log, '{"step": 2}')
    assert log.read_text() == '{"step": 1}\n'


def test_temporaries_a_killed_write_left_are_removed(tmp_path):
    """Only atomic_open's temporary files of that name go: not another file's, not a file the user named alike."""
    stale = [tmp_path / ".drafter.json.k2j4x_1q.tmp", tmp_path / ".drafter.json.a.tmp"]
    kept = [tmp_path / ".params.safetensors.k2j4x_1q.tmp", tmp_path / "drafter.json", tmp_path / ".drafter.json.tmp",
            tmp_path / ".drafter.jsonx.a.tmp"]
    for p in stale + kept:
        p.write_text("{")
    files.remove_temporaries(tmp_path / "drafter.json")
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in kept)

