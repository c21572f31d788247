"""Atomic writes: an interrupted write leaves the previous file whole and no temporary file behind."""

import json
import os
import types

import numpy as np
import pytest

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
