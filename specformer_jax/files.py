"""Files: written so that a crash or Ctrl-C never leaves half of one under its final name, read with one-line errors
for what users point us at, and output places probed before any long work."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

from specformer_jax.errors import SpecformerError


def cache_dir() -> Path:
    """Where the package keeps what it fetches and learns (the default model, tokenizers, decoding records, compiled
    programs): SPECFORMER_CACHE, else XDG_CACHE_HOME/specformer_jax, else ~/.cache/specformer_jax."""
    root = os.environ.get("SPECFORMER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specformer_jax"
    )
    if os.path.exists(root) and not os.path.isdir(root):
        raise SpecformerError(f"the cache directory {root} is a file: set SPECFORMER_CACHE to a directory")
    return Path(root)


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w"):
    """A file object on a temporary file beside `path`, renamed over `path` when the block ends without error:
    readers see the old or the new file, never part of one. An OSError of the write (a full disk, a read-only
    directory) names `path`, not the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY)
    except OSError as e:
        raise _naming(e, path) from None
    try:
        os.chmod(tmp, _mode_for(path))  # mkstemp makes it private (0600)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # KeyboardInterrupt included: leave no temporary file behind
        os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            raise _naming(e, path) from None
        raise


TEMPORARY = ".tmp"  # atomic_open's temporary files are .NAME.XXXXXXXX.tmp beside NAME


def _naming(e: OSError, path: Path) -> OSError:
    """`e` naming `path` (a failed write names no file, a failed mkstemp or rename the temporary one)."""
    if e.errno is None:  # raised without one (OSError("text")): nothing to rebuild it from
        return e
    return type(e)(e.errno, e.strerror, str(path))


def remove_temporaries(path: Path) -> None:
    """Remove the temporary files that atomic_open left beside `path` when its process was killed (SIGKILL, a lost
    machine): call it where no other process writes `path` (an output directory of one's own), before writing it."""
    path = Path(path)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*{TEMPORARY}"):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def _mode_for(path: Path) -> int:
    """The permissions `open(path, "w")` would leave: the old file's, or 0666 less the umask for a new one."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read where the OS shows it (Linux): setting it to read it back would race other threads."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
        return umask


def write_atomic(path: Path, text: str) -> None:
    """`text` written atomically (`atomic_open`)."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: Path, doc) -> None:
    """`doc` as indented JSON, written atomically."""
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def append_line(path: Path, line: str) -> None:
    """`line` and a newline appended to `path` (a log such as metrics.jsonl). A write that fails (a full disk)
    leaves the file as it was, with no part of the line and no empty file where there was none, and its error names
    the file."""
    path = Path(path)
    size = path.stat().st_size if path.exists() else None
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as e:
        with contextlib.suppress(OSError):
            if size is None:
                path.unlink()
            else:
                os.truncate(path, size)
        raise _naming(e, path) from None


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure saved as PNG, atomically (a viewer never shows half a plot), then closed."""
    import matplotlib.pyplot as plt

    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB pieces (what `sha256sum` prints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_text(path: Path, what: str = "file") -> str:
    """The UTF-8 text of a file the user named (`what` it is, for messages): a missing file, a directory or bytes
    that are not UTF-8 text are one-line errors (other OSErrors, e.g. permissions, pass through)."""
    path = Path(path)
    if path.is_dir():
        raise SpecformerError(f"{what} {path} is a directory")
    if not path.exists():
        raise SpecformerError(f"{what} {path} does not exist")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecformerError(f"{what} {path} is not UTF-8 text (byte {e.start})") from None


def read_json(path: Path, what: str = "file"):
    """The JSON document of a file the user named, with read_text's errors and one for text that is not JSON."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as e:
        raise SpecformerError(f"{what} {path} is not valid JSON ({e.msg}, line {e.lineno})") from None


def probe_writable(path: Path, directory: bool = False) -> Path:
    """Refuse, before any work, an output path that could not be written: an existing path of another kind (a
    directory or a device where a file goes), a file the user made read-only, a path under a file, or a place where
    the OS refuses to create a file (permissions, a read-only or virtual file system such as /proc). Creates and
    removes a file in the directory the output goes to (or its nearest existing ancestor)."""
    path, doing = Path(path), "cannot write there"
    try:
        if path.exists() and not (path.is_dir() if directory else path.is_file()):
            raise SpecformerError(f"{path} exists and is not a {'directory' if directory else 'file'}")
        if path.is_file() and not os.access(path, os.W_OK):
            raise SpecformerError(f"{path}: permission denied (the file is read-only)")
        parent = next((a for a in path.absolute().parents if a.exists()), Path(path.absolute().anchor))
        if not parent.is_dir():
            raise SpecformerError(f"{path} lies under {parent}, which is a file")
        probe_dir = path if directory and path.exists() else parent
        doing = f"cannot create a file in {probe_dir}"
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".specformer-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # a parent that cannot be searched, a name too long, a file system that takes no files
        raise SpecformerError(f"{path}: {doing} ({e.strerror or e})") from None
    return path
