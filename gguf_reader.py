"""The GGUF container read directly: header values as Python objects, tensor descriptions, and each
tensor's bytes as a read-only view of the memory-mapped file.

The `gguf` package's GGUFReader builds numpy views for every element of every array in the header;
for a SentencePiece vocabulary of 262,144 tokens (Gemma 3) that alone takes tens of seconds, so the
header is walked here once with `struct`, which also gives every truncation its byte offset. The
`gguf` package still supplies the tensor type table and the dequantizers.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from errors import UserError

# GGUFValueType -> struct format (without byte order); 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_TYPES = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _HeaderCursor:
    """Reads GGUF header fields in order; a read past the end of the file is a truncation."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

    def take(self, n: int) -> int:
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise UserError(f"GGUF file {self.path} is truncated at byte {len(self.buf)} of at least {self.pos} "
                            "(inside its header)")
        return start

    def uint(self, size: int) -> int:
        return struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.buf, self.take(size))[0]

    def text(self, what: str) -> str:
        return self.texts(1, what)[0]

    def texts(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (a key, a vocabulary, its merges), each a length and UTF-8 bytes; a cut in
        either is a truncation. One loop for the whole array: a call per string took 0.44 s of the bundled
        model's load (98k strings)."""
        buf, size, pos, length = self.buf, len(self.buf), self.pos, struct.Struct(self.order + "Q").unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > size:
                self.take(pos + 8 - self.pos)  # raises: a truncation
            end = pos + 8 + length(buf, pos)[0]
            if end > size:
                self.take(end - self.pos)
            try:
                out.append(buf[pos + 8:end].decode("utf-8"))
            except UnicodeDecodeError:
                raise UserError(f"{self.path}: GGUF {what} is not valid UTF-8 (before byte {end})") from None
            pos = end
        self.pos = pos
        return out

    def value(self, kind: int, key: str) -> object:
        if kind == _STRING:
            return self.text(f"key {key}")
        if kind == _ARRAY:
            item, count = self.uint(4), self.uint(8)
            if item in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item]).newbyteorder(self.order)
                start = self.take(dtype.itemsize * count)
                return np.frombuffer(self.buf, dtype, count, start).tolist()
            if item == _STRING:
                return self.texts(count, f"key {key}")
            return [self.value(item, key) for _ in range(count)]
        if kind in _SCALAR_FORMATS:
            fmt = self.order + _SCALAR_FORMATS[kind]
            return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]
        raise UserError(f"{self.path} is not a valid GGUF file (unknown value type {kind} at byte {self.pos})")


@dataclass
class GGUFTensor:
    """One tensor's description; `data` is its bytes, one row (of `shape[0]` values) per line."""

    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int
    row_bytes: int
    file: np.ndarray  # the whole file, memory-mapped read-only

    @property
    def data(self) -> np.ndarray:
        rows = self.n_bytes // self.row_bytes if self.row_bytes else 0
        return self.file[self.offset:self.offset + self.n_bytes].reshape(rows, self.row_bytes)


@dataclass
class GGUFHeader:
    meta: dict
    tensors: list[GGUFTensor]
    extent: int  # the size in bytes the header says the file has (the end of its last tensor's data)


def _walk_header(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], object, int, int, int]], int]:
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _HeaderCursor(buf, path)
        if buf[:4] != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with GGUF)")
        cur.take(4)
        version = cur.uint(4)
        if version & 0xFFFF == 0:  # a version number read with the wrong byte order
            cur.order, version = ">", struct.unpack("<I", struct.pack(">I", version))[0]
        n_tensors, n_kv = cur.uint(8), cur.uint(8)
        # The pseudo-keys GGUFReader lists first, so that a dict of its fields and this one agree.
        meta: dict = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = cur.text("key name")
            meta[key] = cur.value(cur.uint(4), key)
        infos = []
        for _ in range(n_tensors):
            name = cur.text("tensor name")
            dims = tuple(cur.uint(8) for _ in range(cur.uint(4)))
            kind, offset = cur.uint(4), cur.uint(8)
            try:
                qtype = GGMLQuantizationType(kind)
                block, block_bytes = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise UserError(f"{path}: tensor {name} has an unknown GGUF tensor type {kind}") from None
            if dims and dims[0] % block:
                raise UserError(f"{path}: tensor {name} has rows of {dims[0]} values, not a whole number of "
                                f"{qtype.name} blocks of {block}")
            infos.append((name, dims, qtype, offset, math.prod(dims) // block * block_bytes,
                          (dims[0] if dims else 1) // block * block_bytes))
        alignment = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise UserError(f"{path}: GGUF key general.alignment must be positive, got {alignment}")
        data_start = -(-cur.pos // alignment) * alignment
    return meta, [(n, d, q, data_start + o, b, r) for n, d, q, o, b, r in infos], data_start


def read_gguf_header(path: Path) -> GGUFHeader:
    """Header values and tensors of a GGUF file; a truncated or malformed file is one UserError."""
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"GGUF file {path} is empty")
    meta, infos, data_start = _walk_header(path)
    extent = max((offset + n_bytes for _, _, _, offset, n_bytes, _ in infos), default=data_start)
    if size < extent:
        raise UserError(f"GGUF file {path} is truncated at byte {size} of {extent}")
    file = np.memmap(path, dtype=np.uint8, mode="r")
    return GGUFHeader(meta, [GGUFTensor(*info, file=file) for info in infos], extent)


def gguf_extent(path: Path) -> int:
    """The size in bytes the file's header says it has (the end of its last tensor's data)."""
    meta, infos, data_start = _walk_header(path)
    return max((offset + n_bytes for _, _, _, offset, n_bytes, _ in infos), default=data_start)
