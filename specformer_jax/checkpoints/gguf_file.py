"""A GGUF container read in one pass: metadata values and memory-mapped tensor data (quantized blocks left as bytes).

gguf.GGUFReader builds a numpy view per metadata item, which takes seconds for a tokenizer's ~100k strings; this
reads them with plain offsets. Little-endian GGUF versions 2 and 3 (what llama.cpp writes). Dequantization stays
with the gguf package (`gguf.quants.dequantize`), which takes the byte blocks as laid out here.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml tensor types stored as plain numbers; every other type is quantized blocks (read as bytes)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # numpy order: the GGUF dims reversed
    data: np.ndarray  # plain types: numbers of `shape`; quantized: bytes of shape[:-1] x (bytes per row)


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n])
        if len(s) != n:
            raise ValueError("string runs past the end of the file")
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in _SCALARS and etype != 7:  # numbers: one view, no per-item work
                dt = np.dtype(_SCALARS[etype])
                out = np.frombuffer(self.buf, dt, n, self.pos).copy()
                self.pos += n * dt.itemsize
                return out
            return [self.value(etype) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf(path: str | Path) -> tuple[dict, list[Tensor]]:
    """(metadata key -> value, tensors in file order). Raises ValueError (or struct.error) for a damaged file."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(buf[:4]) != MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    c = _Cursor(buf)
    c.pos = 4
    version = c.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("<Q") for _ in range(c.take("<I"))]
        infos.append((name, dims, c.take("<I"), c.take("<Q")))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-c.pos // align) * align
    tensors = []
    for name, dims, ttype, offset in infos:
        shape = tuple(int(d) for d in reversed(dims)) or (1,)
        count = int(np.prod(shape))
        if ttype in _PLAIN:
            dt = np.dtype(_PLAIN[ttype])
            data = np.frombuffer(buf, dt, count, start + offset).reshape(shape)
        else:
            block, nbytes = _block_size(ttype)
            row_bytes = shape[-1] // block * nbytes
            data = np.frombuffer(buf, np.uint8, count // block * nbytes, start + offset).reshape(*shape[:-1], row_bytes)
        tensors.append(Tensor(name, ttype, shape, data))
    return meta, tensors


def _block_size(ttype: int) -> tuple[int, int]:
    """(elements, bytes) per block of a quantized ggml type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown ggml tensor type {ttype}") from None
