"""Where a model's weights live on the CPU: one mapping of transparent huge pages (2 MiB), in the order the decode
step reads them.

A decode step reads every weight once, start to end, as one stream (:mod:`decoderlab.kernels`' products). In the
4 KiB pages PyTorch's allocator hands out, SmolLM2-135M's float16 weights (270 MB) span 66,000 pages: the stream
misses the TLB every 4 KiB and its page walks stall the read. In 2 MiB pages they span 135. Measured on an AMD EPYC
with AVX-512 (2026-12-07, one thread, SmolLM2's 211 products of a token through ``dense_linear``): float16 12.6 ->
9.9 ms, bfloat16 12.5 -> 9.4, float32 29.9 -> 22.6 (1.28-1.33x); a plain read of the same bytes gains as much.
llama.cpp's step reads its weights near the floor of the huge pages' read. ``bench/llamacpp.py`` has the decode.

:func:`huge_pages` copies a model's CPU parameters and buffers into one anonymous private mapping advised
``MADV_HUGEPAGE`` (Linux's transparent huge pages: honoured where ``/sys/kernel/mm/transparent_hugepage/enabled``
says ``always`` or ``madvise``, the kernel's default), each tensor getting a storage of its own over its slice --
so nothing else sees a difference: ``state_dict``, safetensors, ``.to()`` and ``deepcopy`` read them as any tensor.
Elsewhere (macOS, Windows, THP off) it moves nothing and says so by its return value. The loaders call it
(:func:`decoderlab.chat.load_model`); a model built in code can call it itself.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch
from torch import nn

#: a huge page: the mapping's first tensor starts on one
HUGE_PAGE = 2 << 20
#: every tensor's offset in the mapping is a multiple of this (a cache line: the kernels' loads never split one)
ALIGN = 64
#: freed memory is handed back to the system after every this many bytes moved, so that the old copies never all
#: sit beside the new one (glibc keeps small freed blocks in its heap until trimmed)
TRIM_EVERY = 64 << 20


def available() -> bool:
    """Whether this platform can advise transparent huge pages (Linux, Python's ``mmap.MADV_HUGEPAGE``)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _owners(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str, str]]]]:
    """Each distinct CPU tensor of ``model`` (a tied weight once) in the order the modules hold them: the tensor
    and every (module, ``"_parameters"`` or ``"_buffers"``, name) that holds it."""
    found: dict[int, tuple[torch.Tensor, list]] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(module, kind).items():
                if t is not None and t.device.type == "cpu" and t.numel():
                    found.setdefault(id(t), (t, []))[1].append((module, kind, name))
    return found


def _movable(found: dict) -> list[tuple[torch.Tensor, list]]:
    """The tensors that own their storage whole, alone: a view, or a storage two tensors share, stays where it is
    (moving one would part them)."""
    per_storage: dict[int, int] = {}
    for t, _ in found.values():
        key = t.untyped_storage().data_ptr()
        per_storage[key] = per_storage.get(key, 0) + 1
    out = []
    for t, holders in found.values():
        storage = t.untyped_storage()
        whole = (t.is_contiguous() and t.data_ptr() == storage.data_ptr()
                 and t.numel() * t.element_size() == storage.nbytes())
        if whole and per_storage[storage.data_ptr()] == 1:
            out.append((t, holders))
    return out


def _trim() -> None:
    """Hand glibc's freed heap memory back to the system (nothing where the C library has no ``malloc_trim``)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _mapping(nbytes: int) -> mmap.mmap | None:
    """An anonymous private mapping of ``nbytes`` plus a huge page (to start on one), advised huge; None where
    the kernel refuses the advice."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
        mm.close()
        return None
    return mm


def huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Move ``model``'s CPU parameters and buffers into one mapping of transparent huge pages, in module order
    (the order a decode step reads them); returns the bytes moved.

    A parameter keeps its ``nn.Parameter`` (its ``.data`` is replaced: tied weights stay tied, ``requires_grad``
    stays); a buffer is replaced in every module that holds it. Views and storages shared by several tensors stay
    where they are. Moves nothing (returns 0) off Linux, where the kernel refuses the advice, or when the movable
    tensors come to less than ``min_bytes`` (one huge page: nothing to gain). The values are copied exactly.
    """
    if not available():
        return 0
    tensors = _movable(_owners(model))
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t, _ in tensors]
    if sum(sizes) < min_bytes:
        return 0
    mm = _mapping(sum(sizes))
    if mm is None:
        return 0
    offset = -torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    since_trim, moved = 0, sum(sizes)
    tensors.reverse()  # (popped from the end in module order: each old copy is freed as soon as it is moved)
    sizes.reverse()
    with torch.no_grad():
        while tensors:
            (t, holders), size = tensors.pop(), sizes.pop()
            new = torch.frombuffer(mm, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
            new.copy_(t)
            for module, kind, name in holders:
                if kind == "_parameters":
                    module._parameters[name].data = new
                else:
                    module._buffers[name] = new
            offset, since_trim = offset + size, since_trim + size
            del t
            if since_trim >= TRIM_EVERY:
                _trim()
                since_trim = 0
    _trim()
    return moved
