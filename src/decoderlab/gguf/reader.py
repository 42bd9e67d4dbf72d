"""The bytes of a GGUF file: its metadata (key -> value) and its tensors' names, GGML types, shapes and data,
memory-mapped, each checked against the file's size before anything is read.

The layout is ggml's GGUF v2/v3 (little-endian): ``"GGUF"``, the version (u32), the tensor count and the
metadata count (u64 each), the metadata (a key string, a value type, a value; arrays as an item type, a count
and the items), one entry per tensor (name, number of dimensions, ggml's dimensions -- innermost first --, the
GGML type, the offset of its data), then the data, aligned to ``general.alignment`` (32 by default).

Why not ``gguf.GGUFReader``: it builds a NumPy view for every item of every array, two per string, which for
SmolLM2's 49,152 tokens and 48,900 merges is about a million views -- 5 to 8 s of the 10 s a load of the file
may take on a 2-core machine (the parse here takes 0.2 s). ``gguf``'s own enums, block sizes and
dequantizers are used throughout, and tests/gguf/test_reader.py checks every field and tensor entry
read here against ``GGUFReader``'s.

Source: the GGUF specification (ggml-org/ggml, docs/gguf.md).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: value type -> (struct format, size) of GGUF's scalar metadata types
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        type: its GGML type (``gguf.GGMLQuantizationType``).
        shape: the logical shape in NumPy's order, outermost first -- (rows, cols) for a matrix, as PyTorch's
            ``nn.Linear`` weight (ggml's dimensions reversed).
        offset: where its data starts in the file (bytes).
        nbytes: the bytes of its data.
    """

    name: str
    type: object
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def past_the_end(path: Path, size: int, n: int, start: int, what: str) -> ValueError:
    """The one-line error of ``n`` bytes of ``what`` needed at byte ``start`` of a file of ``size`` bytes that
    ends before them: the size, the bytes wanted and where, numbers with thousands separators."""
    return ValueError(f"{path} is truncated or corrupt: the file is {size:,} bytes, but {what} needs {n:,} bytes at "
                      f"byte {start:,} (bytes {start:,} to {start + n - 1:,})")


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, naming the file, the field being read (``field``) and the
    bytes it needs when the file ends too soon."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path
        self.field = "the header"

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise past_the_end(self.path, len(self.buf), n, start, f"its header ({self.field})")
        self.pos += n
        return start

    def scalar(self, vtype: int):
        fmt, size = _SCALARS[vtype]
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        start = self.take(n)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path} is corrupt: a string at byte {start} is not UTF-8") from None

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"{self.path} is corrupt: unknown metadata value type {vtype} at byte {self.pos - 4}")
        item, count = self.scalar(4), self.scalar(10)
        if item in _NUMPY:  # numbers: one NumPy read (token types, scores)
            dt = np.dtype(_NUMPY[item])
            start = self.take(count * dt.itemsize)
            return np.frombuffer(self.buf, dtype=dt, count=count, offset=start).tolist()
        if count > len(self.buf):  # every item takes at least one byte: a corrupt count, before any loop
            self.take(count)
        if item == _STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary), read as :meth:`string` reads one, in one loop with no
        method call per item: Gemma 3's 262,144 tokens took 1.4 s through :meth:`string`, 0.2 s here."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            n = length(buf, pos)[0]
            if pos + 8 + n > end:
                break
            try:
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"{self.path} is corrupt: a string at byte {pos + 8} is not UTF-8") from None
            pos += 8 + n
        self.pos = pos
        if len(out) < count:  # the file ends inside a string: string() names the bytes it needs
            self.string()
        return out


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (key -> Python value: numbers, strings, lists) and
    ``tensors`` (name -> :class:`TensorEntry`, in the file's order); :meth:`data` gives a tensor's bytes as a
    read-only memory-mapped NumPy array.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file (the magic), a version other than 2 or 3, a header or a tensor's data that
            runs past the end of the file (truncated or corrupt), an unknown GGML type, a tensor named twice --
            each naming the file.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        size = self.path.stat().st_size
        if size < 24:
            raise ValueError(f"{self.path} is not a GGUF file: {size} bytes, too short for a header")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), self.path)  # slices of a memoryview are cheap; of a memmap, not
        if bytes(self._map[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        cur.take(4)
        cur.field = "the version and the counts"
        self.version = cur.scalar(4)
        if self.version not in _VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {self.version} is not read here; allowed: 2, 3")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        if n_tensors > size or n_kv > size:
            raise ValueError(f"{self.path} is corrupt: it claims {n_tensors} tensors and {n_kv} metadata keys")
        self.metadata = {}
        for i in range(n_kv):
            cur.field = f"metadata entry {i + 1} of {n_kv}"
            key = cur.string()
            cur.field = f"metadata key {key}"
            self.metadata[key] = cur.value(cur.scalar(4))
        entries = []
        for i in range(n_tensors):
            cur.field = f"tensor entry {i + 1} of {n_tensors}"
            entries.append(self._entry(cur, gguf))
        align = int(self.metadata.get("general.alignment", 32))
        start = (cur.pos + align - 1) // align * align
        self.tensors = {}
        for name, qtype, shape, offset, nbytes in entries:
            if name in self.tensors:
                raise ValueError(f"{self.path} is corrupt: tensor {name} is named twice")
            if start + offset + nbytes > size:
                raise past_the_end(self.path, size, nbytes, start + offset, f"tensor {name}'s data")
            self.tensors[name] = TensorEntry(name, qtype, shape, start + offset, nbytes)

    def _entry(self, cur: _Cursor, gguf):
        name = cur.string()
        cur.field = f"tensor {name}'s entry"
        n_dims = cur.scalar(4)
        if not 1 <= n_dims <= 4:
            raise ValueError(f"{self.path} is corrupt: tensor {name} has {n_dims} dimensions (1 to 4 allowed)")
        dims = [cur.scalar(10) for _ in range(n_dims)]
        raw_type, offset = cur.scalar(4), cur.scalar(10)
        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name} has GGML type {raw_type}, which the gguf package does not "
                             "know") from None
        if dims[0] % block:
            raise ValueError(f"{self.path} is corrupt: tensor {name} has rows of {dims[0]} values, not a multiple of "
                             f"{qtype.name}'s blocks of {block}")
        nbytes = int(np.prod(dims[1:], dtype=np.int64)) * (dims[0] // block) * type_size
        return name, qtype, tuple(int(d) for d in reversed(dims)), offset, nbytes

    def data(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as a read-only uint8 array of shape (rows, bytes per row): for a matrix,
        one row of blocks per output row (a 1-D tensor is one row)."""
        t = self.tensors[name]
        flat = self._map[t.offset:t.offset + t.nbytes]
        rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        return flat.reshape(rows, t.nbytes // rows)

    def release(self, name: str) -> None:
        """Give back the resident pages of tensor ``name``'s bytes once they are copied out (``madvise``
        ``MADV_DONTNEED``: a read-only file map's pages stay in the page cache, but leave this process's resident
        memory) -- so that a load's peak holds the file's bytes once, not the map and the copies both. A no-op
        where the platform has no ``madvise``."""
        import mmap

        t = self.tensors[name]
        raw = getattr(self._map, "_mmap", None)
        if raw is None or not hasattr(raw, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-t.offset // page) * page  # whole pages inside the tensor only (its neighbours may be in use)
        stop = (t.offset + t.nbytes) // page * page
        if stop > start:
            raw.madvise(mmap.MADV_DONTNEED, start, stop - start)

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (llama.cpp's name: ``llama``, ``qwen2``, ``gpt2``, ...), or None."""
        return self.metadata.get("general.architecture")
