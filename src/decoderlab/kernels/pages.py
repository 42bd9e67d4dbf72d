"""Where a model's weights live on the CPU: in transparent huge pages (2 MiB), not 4 KiB ones.

A decode step reads every weight once, start to end, as one stream (:mod:`decoderlab.kernels`' products). In the
4 KiB pages PyTorch's allocator hands out, SmolLM2-135M's float16 weights (270 MB) span 66,000 pages: the stream
misses the TLB every 4 KiB and its page walks stall the read. In 2 MiB pages they span 135. Measured on an AMD EPYC
with AVX-512 (2026-12-07, one thread, SmolLM2's 211 products of a token through ``dense_linear``): float16 12.6 ->
9.9 ms, bfloat16 12.5 -> 9.4, float32 29.9 -> 22.6 (1.28-1.33x); a plain read of the same bytes gains as much.
llama.cpp's step reads its weights near the floor of the huge pages' read. ``bench/llamacpp.py`` has the decode.

:func:`huge_pages` makes the pages under a model's CPU parameters and buffers huge. Where the kernel can
(Linux 6.1+: ``madvise(MADV_COLLAPSE)``) it does so in place -- each storage's memory rounded out to 2 MiB, nothing
copied by us, no tensor replaced, no memory beside it: Gemma 3's 140 MB embedding is collapsed where it lies. On an
older Linux it copies them into one anonymous private mapping advised ``MADV_HUGEPAGE``, in module order, each
tensor a storage of its own over its slice (``state_dict``, safetensors, ``.to()`` and ``deepcopy`` read them as
any tensor); old copies are freed as they go, but the largest tensor sits twice for a moment. Transparent huge
pages must not be ``never`` in ``/sys/kernel/mm/transparent_hugepage/enabled``. Elsewhere (macOS, Windows) it does
nothing and says so by its return value. The one loader calls it (:func:`decoderlab.chat.load_model`); a model
built in code can call it itself.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading
from collections.abc import Callable, Iterable

import torch
from torch import nn

#: a huge page: the mapping's first tensor starts on one
HUGE_PAGE = 2 << 20
#: madvise's advice to make a range's pages huge in place, now (Linux 6.1; Python's mmap names it from 3.13 only)
MADV_COLLAPSE = 25
#: every tensor's offset in the mapping is a multiple of this (a cache line: the kernels' loads never split one)
ALIGN = 64
#: freed memory is handed back to the system after every this many bytes moved, so that the old copies never all
#: sit beside the new one (glibc keeps small freed blocks in its heap until trimmed)
TRIM_EVERY = 64 << 20


#: the kernel's switch for transparent huge pages: ``always [madvise] never``, the bracketed one in force
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def available() -> bool:
    """Whether this platform gives transparent huge pages on request: Linux (Python's ``mmap.MADV_HUGEPAGE``),
    its kernel built with them and not switched to ``never`` (:data:`THP_SETTING`)."""
    if not (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")):
        return False
    try:
        with open(THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:  # a kernel without transparent huge pages
        return False


@functools.cache
def _libc():
    """This process's C library, its ``madvise`` typed (loaded once)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


@functools.cache
def collapse_works() -> bool:
    """Whether this kernel collapses a range into huge pages in place (``MADV_COLLAPSE``): tried once on a
    mapping of its own."""
    if not available():
        return False
    mm = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        view = torch.frombuffer(mm, dtype=torch.uint8)
        view.fill_(1)
        start = -(-view.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the huge page inside the two
        ok = start + HUGE_PAGE <= view.data_ptr() + len(mm) and _libc().madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0
        del view
        return ok
    finally:
        mm.close()


def _spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The address ranges of the distinct CPU storages of ``tensors``, in address order."""
    return sorted({(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in
                   (t.untyped_storage() for t in tensors if t.device.type == "cpu" and t.numel())})


def _collapse(spans: list[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """``MADV_COLLAPSE`` over each span rounded out to whole huge pages (a page two spans share, once); returns
    the bytes of the spans made huge and the spans left -- memory the kernel cannot collapse: a file's pages (a
    safetensors file's tensors map it), a small span's page reaching past its mapping, none free now."""
    libc, tried, done, left = _libc(), {}, 0, []
    for lo, hi in spans:
        ok = {p: tried.setdefault(p, libc.madvise(p, HUGE_PAGE, MADV_COLLAPSE) == 0)
              for p in range(lo // HUGE_PAGE * HUGE_PAGE, hi, HUGE_PAGE)}
        inside = [v for p, v in ok.items() if lo <= p and p + HUGE_PAGE <= hi]
        # a span's whole pages must collapse; its two end pages may reach past its mapping (a tensor glibc mapped
        # on its own) and stay small -- but a span with no whole page (under 2 MiB) needs its end pages
        if all(inside) if inside else all(ok.values()):
            done += hi - lo
        else:
            left.append((lo, hi))
    return done, left


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
        _libc().malloc_trim(0)
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
    """Put ``model``'s CPU parameters and buffers in transparent huge pages; returns the bytes now in them.

    In place where the kernel collapses ranges (:func:`collapse_works`): nothing moves, each storage's memory
    rounded out to whole huge pages. The rest -- every storage on a kernel without ``MADV_COLLAPSE``, the
    file-backed ones (a safetensors checkpoint's) on one with it -- copied, in module order, into one mapping
    advised ``MADV_HUGEPAGE``: a parameter keeps its ``nn.Parameter`` (its ``.data`` replaced: tied weights stay
    tied, ``requires_grad`` stays); a buffer is replaced in every module that holds it; views and storages shared
    by several tensors stay where they are. Does nothing (returns 0) off Linux, where the kernel refuses huge
    pages, or when the tensors come to less than ``min_bytes`` (one huge page: nothing to gain). The values are
    never changed.
    """
    if not available():
        return 0
    spans = _spans((*model.parameters(), *model.buffers()))
    if sum(hi - lo for lo, hi in spans) < min_bytes:
        return 0
    done, left = _collapse(spans) if collapse_works() else (0, spans)
    return done + (_copy(model, {lo for lo, _ in left}) if left else 0)


def collapse_in_background(tensors: Iterable[torch.Tensor]) -> Callable[[], None]:
    """Start collapsing the pages under ``tensors``' CPU storages in place on a thread (the kernel's work: the
    thread waits in ``madvise`` without the GIL), so that a loader builds its tokenizer meanwhile; returns the
    function that waits for it. Where the kernel cannot collapse (:func:`collapse_works`), starts nothing.
    :func:`huge_pages` afterwards finds those pages huge (~0.4 ms for 190 MB) and does the rest. Gemma 3's GGUF
    load (AMD EPYC, 2026-12-07): its 299 MB collapsed in 0.8 s, its tokenizer built in 1.6."""
    if not (available() and collapse_works()):
        return lambda: None
    thread = threading.Thread(target=_collapse, args=(_spans(tensors),), name="huge pages", daemon=True)
    thread.start()
    return thread.join


def _copy(model: nn.Module, starts: set[int]) -> int:
    """:func:`huge_pages` for the storages starting at ``starts`` (those not collapsed in place): their tensors
    copied into one advised mapping; returns the bytes copied."""
    tensors = [(t, h) for t, h in _movable(_owners(model)) if t.untyped_storage().data_ptr() in starts]
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t, _ in tensors]
    if not tensors:
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
