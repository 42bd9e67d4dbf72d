"""The weight files of a Hugging Face directory, read in place: ``model.safetensors``, a sharded
``model.safetensors.index.json`` (+ its shards), or an old ``pytorch_model.bin``; and the one writer.

Reading maps each file into memory (``mmap``) and hands out tensors that are views of the file's pages, so a
tensor costs no memory until it is read; once the loader has copied it into the model (converted to the
model's dtype, the parts of a fused projection put side by side) :meth:`WeightFiles.release` gives its pages
back (``madvise(MADV_DONTNEED)``). A whole model is so loaded with one copy of its weights in memory (the
model's) and at most one tensor of the file besides: safetensors' own reader would copy every tensor out of a
mapping that stays resident until the file is closed -- the weights twice.

The safetensors layout read here is the format's whole specification: 8 bytes (little-endian u64) giving the
length N of a JSON header, the header ({name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
"__metadata__"}), then the data, offsets counted from the byte after the header.

Every error names the file, the tensor or field, and what is allowed. Source: the safetensors format
(huggingface/safetensors, "Format"); Hugging Face's sharded index (``weight_map``: tensor name -> shard file).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Mapping

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILE = "pytorch_model.bin"
#: the dtypes a weight file may hold (safetensors' names); every other is refused, naming the tensor
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_PAGE = mmap.PAGESIZE


class _Mapped:
    """One safetensors file, mapped: its header's entries and the mapping the views read."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{path}: not a safetensors file (its header length {n} runs past the end of "
                                 f"the file's {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.base = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e, size)

    def _entry(self, name: str, e, size: int):
        try:
            kind, shape, (begin, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{self.path}: tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if kind not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {kind}; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[kind]
        count = 1
        for s in shape:
            count *= s
        if end - begin != count * dtype.itemsize or begin < 0 or self.base + end > size:
            raise ValueError(f"{self.path}: tensor {name!r} ({kind}, shape {shape}) has data_offsets [{begin}, {end}] "
                             f"that do not fit its size or the file's {size} bytes (a truncated or damaged file)")
        return dtype, shape, self.base + begin, self.base + end

    def view(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.map, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                offset=begin).view(shape)

    def release(self, name: str) -> None:
        _, _, begin, end = self.entries[name]
        start = begin - begin % _PAGE  # whole pages only; a page shared with a neighbour is simply read again
        if self.map is not None and end > start and hasattr(self.map, "madvise"):
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)


class WeightFiles:
    """The tensors of a Hugging Face directory's weight files, by name (as the files spell them).

    ``shape(name)`` / ``dtype(name)`` read the headers only; ``view(name)`` is the tensor as stored (a view of
    the mapped file: no copy, read-only in spirit), ``release(name)`` drops its pages once copied, ``where(name)``
    the file it is in (for messages). A ``Mapping`` of tensors (an in-memory state dict) is read the same way
    through :meth:`of_state`.

    Raises (when opened):
        FileNotFoundError: no weight file (naming the three that are read); a shard the index lists is missing.
        ValueError: an index that is not JSON or has no ``weight_map``; a shard that does not hold the tensors
            the index puts in it, or holds others (inconsistent shards); a tensor in two files; a damaged file
            or a dtype other than F32 / BF16 / F16.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._files: dict[str, _Mapped] = {}  # tensor name -> its file
        self._state: Mapping[str, torch.Tensor] | None = None
        single, index, pickled = (self.directory / n for n in (SINGLE_FILE, INDEX_FILE, PICKLE_FILE))
        if single.is_file():
            mapped = _Mapped(single)
            self._files = dict.fromkeys(mapped.entries, mapped)
        elif index.is_file():
            self._open_shards(index)
        elif pickled.is_file():
            self._state = torch.load(pickled, map_location="cpu", mmap=True, weights_only=True)
            self._where = str(pickled)
        else:
            raise FileNotFoundError(f"{self.directory} has no weights file; expected {SINGLE_FILE}, {INDEX_FILE} "
                                    f"(with its shards) or {PICKLE_FILE}")

    @classmethod
    def of_state(cls, state: Mapping[str, torch.Tensor], where: str = "state dict") -> "WeightFiles":
        """A state dict (name -> tensor) read through the same calls; ``where`` names it in messages."""
        self = cls.__new__(cls)
        self.directory, self._files, self._state, self._where = None, {}, state, where
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"{where}: value of {bad[0]!r} is a {type(state[bad[0]]).__name__}, not a tensor")
        return self

    def _open_shards(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise ValueError(f"{index}: not a sharded index (a JSON object with a weight_map of tensor name -> "
                             "shard file)") from None
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(shard), []).append(name)
        for shard, names in shards.items():
            path = self.directory / shard
            if Path(shard).name != shard or not path.is_file():
                raise FileNotFoundError(f"{index}: shard {shard} (holding {names[0]!r}"
                                        f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) is missing")
            mapped = _Mapped(path)
            absent = [n for n in names if n not in mapped.entries]
            extra = sorted(set(mapped.entries) - set(names))
            if absent or extra:
                what = (f"lacks {absent[:3]} that the index puts there" if absent
                        else f"holds {extra[:3]} that the index puts elsewhere or nowhere")
                raise ValueError(f"{path}: inconsistent shard: it {what}; the index {index.name} and its shards "
                                 "must list the same tensors")
            self._files.update(dict.fromkeys(names, mapped))

    def names(self) -> list[str]:
        return list(self._state) if self._state is not None else list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in (self._state if self._state is not None else self._files)

    def where(self, name: str | None = None) -> str:
        """The file holding ``name`` (the directory's weight file when None), for messages."""
        if self._state is not None:
            return self._where
        if name is not None and name in self._files:
            return str(self._files[name].path)
        return str(next(iter(self._files.values())).path) if self._files else str(self.directory)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._state is not None:
            return tuple(self._state[name].shape)
        return self._files[name].entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        if self._state is not None:
            return self._state[name].dtype
        return self._files[name].entries[name][0]

    def view(self, name: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[name]
        return self._files[name].view(name)

    def release(self, name: str) -> None:
        if self._state is None:
            self._files[name].release(name)


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> tensor) as one safetensors file at ``path`` (safetensors' own writer), with
    ``metadata`` (Hugging Face's ``{"format": "pt"}`` by default). Tensors are made contiguous, on the CPU."""
    from safetensors.torch import save_file

    out = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(out, str(path), metadata={"format": "pt", **(metadata or {})})
