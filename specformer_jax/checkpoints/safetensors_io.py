"""Memory-mapped safetensors reading into numpy (bfloat16 via ml_dtypes), with clear errors for corrupt files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from specformer_jax.errors import SpecformerError
from specformer_jax.files import atomic_open

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as (read-only, memory-mapped) numpy arrays."""
    size = path.stat().st_size
    try:
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", bytes(buf[:8]))
        if n > size - 8:
            raise ValueError("header length runs past the end of the file")
        header = json.loads(bytes(buf[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        data = buf[8 + n :]
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(meta, dict):
                raise ValueError(f"tensor {name!r} has no JSON object describing it")
            lo, hi = meta["data_offsets"]
            dtype = np.dtype(_DTYPES[meta["dtype"]])
            shape = tuple(meta["shape"])
            if not 0 <= lo <= hi <= data.size or hi - lo != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(f"tensor {name!r} does not fit its byte range")
            out[name] = data[lo:hi].view(dtype).reshape(shape)
        return out
    except (ValueError, KeyError, TypeError, struct.error, UnicodeDecodeError) as e:
        raise SpecformerError(f"corrupt safetensors file {path}: {e}") from None


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write tensors atomically, so a crash never leaves a half-written file in place."""
    header, offset, blobs = {}, 0, []
    for name, x in tensors.items():
        x = np.ascontiguousarray(x)
        header[name] = {"dtype": _NAMES[x.dtype], "shape": list(x.shape), "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
        blobs.append(x)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for x in blobs:
            f.write(x.tobytes())
