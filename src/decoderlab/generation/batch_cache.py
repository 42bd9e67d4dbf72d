"""The batch KV cache of continuous batching: one key/value store whose rows join and leave while others decode.

The scheduler (:mod:`decoderlab.generation.scheduler`) decides which requests run; this module only keeps
their keys and values, as vLLM keeps its KV-cache manager apart from its scheduler.

Every row's keys/values are right-aligned on one timeline of columns: a row that holds W tokens occupies
columns ``length - W .. length - 1`` of its slot; the columns before them are hidden by a (B, T_k) padding
mask and each row gets its own positions (its tokens count from 0, as when generated alone). A decode step
writes one column for every running row (:class:`SlotLayer` is what a model's attention layer sees, the
interface of :class:`decoderlab.attention.LayerKVCache`). A row joins by :meth:`BatchKVCache.place` (its
prefilled keys/values copied in, ending at the timeline's end) and leaves by :meth:`BatchKVCache.remove_slot`
(the last slot moves into its place, so the running rows stay 0 .. n-1). When the timeline is full, the
columns no row uses any more are dropped (:meth:`BatchKVCache.compact`).

Source: the continuous ("iteration-level") batching of Orca (Yu et al., OSDI 2022); written here over
decoderlab's own KV cache, contiguous per row rather than vLLM's pages.
"""

from __future__ import annotations

import torch

from ..attention import KVCache, LayerKVCache


class SlotLayer(LayerKVCache):
    """One layer's keys/values for every slot: (S, H_kv, capacity, d_head), allocated by the owning
    :class:`BatchKVCache`; rows 0 .. n-1 are the running ones. ``update`` is what a model's attention calls
    (the interface of ``LayerKVCache``), writing the n running rows only."""

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        n, start = k_new.size(0), o.length
        end = start + k_new.size(2)
        if n != o.n or end > o.capacity:
            raise RuntimeError(f"batch cache misuse: {n} rows for {o.n} slots, end {end} > {o.capacity}")
        self.k[:n, :, start:end] = k_new
        self.v[:n, :, start:end] = v_new
        return self.k[:n, :, :end], self.v[:n, :, :end]


class BatchKVCache:
    """A KV cache whose rows join and leave (see the module docstring).

    Args:
        n_layer: number of decoder blocks.
        capacity: columns of the timeline (the scheduler gives 2 x max_len, so that rows of different ages fit
            before a compaction).

    ``length`` is the timeline's used columns, ``n`` the running rows (slots 0 .. n-1), ``start_col[i]`` slot
    i's first column. The buffers, (slots, H, capacity, d_head) per layer, are allocated when the first row is
    placed (with its dtype and device) and doubled when more rows run than they hold.
    """

    static = False  # its shapes grow with the timeline (see attention.KVCache)

    def __init__(self, n_layer: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.n = 0
        self.slots = 0
        self.start_col: list[int] = []
        self.layers = [SlotLayer(self) for _ in range(n_layer)]

    def advance(self, t: int) -> None:
        self.length += t

    def _grow(self, like: torch.Tensor, want: int) -> None:
        if want <= self.slots:
            return
        new_slots = max(want, 2 * self.slots, 4)
        _, h, _, d = like.shape
        for lay in self.layers:
            k = like.new_zeros(new_slots, h, self.capacity, d)  # zeros: never NaN under a mask
            v = like.new_zeros(new_slots, h, self.capacity, d)
            if lay.k is not None:
                k[: self.slots] = lay.k
                v[: self.slots] = lay.v
            lay.k, lay.v = k, v
        self.slots = new_slots

    def _shift(self, d: int) -> None:
        """Move every running row d columns (right for d > 0, left for d < 0)."""
        n, length = self.n, self.length
        if d == 0 or n == 0:
            return
        for lay in self.layers:
            for t in (lay.k, lay.v):
                if d > 0:
                    t[:n, :, d : d + length] = t[:n, :, :length].clone()
                else:
                    t[:n, :, : length + d] = t[:n, :, -d:length].clone()
        self.length += d
        self.start_col = [c + d for c in self.start_col]

    def compact(self) -> None:
        """Drop the leading columns no running row uses."""
        if self.n == 0:
            self.length = 0
            return
        m = min(self.start_col)
        if m > 0:
            self._shift(-m)

    def add_slot(self) -> int:
        self.n += 1
        self.start_col.append(self.length)
        return self.n - 1

    def place(self, slot: int, src: KVCache, w: int, src_row: int = 0, src_start: int = 0) -> None:
        """Copy ``w`` cached tokens of row ``src_row`` of the cache ``src`` (from column ``src_start``: after a
        left-padded prefill's pads) into ``slot``, ending at the timeline's current end (moving the other rows
        right when the timeline is shorter than ``w``)."""
        like = src.layers[0].k
        self._grow(like, self.n)
        if self.length < w:
            if self.n > 1:
                self._shift(w - self.length)
            self.length = w
        if self.length > self.capacity:
            raise RuntimeError("batch cache overflow")
        c = self.length - w
        for lay, s in zip(self.layers, src.layers):
            lay.k[slot, :, c : self.length] = s.k[src_row, :, src_start : src_start + w]
            lay.v[slot, :, c : self.length] = s.v[src_row, :, src_start : src_start + w]
        self.start_col[slot] = c

    def remove_slot(self, slot: int) -> int | None:
        """Release ``slot``; the last running slot moves into it. Returns the index that moved (or None)."""
        last = self.n - 1
        moved = None
        if slot != last:
            for lay in self.layers:
                lay.k[slot, :, : self.length] = lay.k[last, :, : self.length]
                lay.v[slot, :, : self.length] = lay.v[last, :, : self.length]
            self.start_col[slot] = self.start_col[last]
            moved = last
        self.start_col.pop()
        self.n -= 1
        if self.n == 0:
            self.length = 0
        return moved
