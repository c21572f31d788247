"""notebooks/quickstart.ipynb runs top to bottom (default model and drafter, CPU)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from specformer_jax.checkpoints.default import GGUF_NAME
from specformer_jax.files import cache_dir

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # about 50 s: a kernel, the default model, several compilations
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # The kernel is another process, with a cache of its own that sees the default model's files where they are:
    # the notebook uses the Python API, which must leave no decoding records there.
    real = cache_dir()
    for name in (GGUF_NAME, "tokenizers"):
        if (real / name).exists():
            (tmp_path / name).symlink_to(real / name)
    monkeypatch.setenv("SPECFORMER_CACHE", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    resources = {"metadata": {"path": str(NOTEBOOK.parent)}}
    NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "Paris" in text and "mean accepted length" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot
    assert not (tmp_path / "decode_records.json").exists()  # the Python API records only into a store it is given
