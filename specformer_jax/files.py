"""Writing files so that a crash or Ctrl-C never leaves half of one under its final name."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt included: leave no temporary file behind
        os.unlink(tmp)
        raise


def write_json(path: Path, doc) -> None:
    """`doc` as indented JSON, written atomically."""
    write_atomic(path, json.dumps(doc, indent=1) + "\n")
