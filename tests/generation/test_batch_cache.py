"""The batch KV cache: rows placed at the timeline's end, right-aligned; a removed slot filled by the last one;
compaction dropping the columns no row uses; a decode step writing one column for every running row. Checked
against the keys/values each row was given, column by column."""

import pytest
import torch

from decoderlab.attention import KVCache
from decoderlab.generation.batch_cache import BatchKVCache

H, D = 2, 3


def prefilled(lengths: list[int], seed: int) -> tuple[KVCache, list[torch.Tensor]]:
    """A one-layer KVCache holding len(lengths) left-padded rows (pads first), and each row's real keys."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    src = KVCache(1, 16)
    k = torch.randn(len(lengths), H, t, D, generator=g)
    src.layers[0].update(k, -k)
    src.advance(t)
    return src, [k[i, :, t - w:] for i, w in enumerate(lengths)]


def row_keys(cache: BatchKVCache, slot: int) -> torch.Tensor:
    lay = cache.layers[0]
    return lay.k[slot, :, cache.start_col[slot]:cache.length]


def test_rows_are_right_aligned_and_a_longer_newcomer_moves_the_others_right():
    cache = BatchKVCache(1, 16)
    src, keys = prefilled([3, 5], seed=0)
    a = cache.add_slot()
    cache.place(a, src, 3, src_row=0, src_start=2)
    assert (cache.length, cache.start_col) == (3, [0])
    b = cache.add_slot()
    cache.place(b, src, 5, src_row=1, src_start=0)  # longer than the timeline: row a moves 2 columns right
    assert (cache.length, cache.start_col) == (5, [2, 0])
    assert torch.equal(row_keys(cache, a), keys[0])
    assert torch.equal(row_keys(cache, b), keys[1])
    assert torch.equal(cache.layers[0].v[a, :, 2:5], -keys[0])


def test_a_decode_step_writes_one_column_per_running_row_and_remove_moves_the_last_slot():
    cache = BatchKVCache(1, 16)
    src, keys = prefilled([2, 4, 3], seed=1)
    for j, w in enumerate([2, 4, 3]):
        cache.place(cache.add_slot(), src, w, src_row=j, src_start=4 - w)
    new = torch.randn(3, H, 1, D)
    k, v = cache.layers[0].update(new, -new)
    cache.advance(1)
    assert k.shape == (3, H, 5, D) and torch.equal(k[:, :, -1:], new) and torch.equal(v, -k)
    moved = cache.remove_slot(0)
    assert moved == 2 and cache.n == 2 and cache.start_col == [1, 0]
    assert torch.equal(row_keys(cache, 0), torch.cat([keys[2], new[2]], dim=1))
    assert torch.equal(row_keys(cache, 1), torch.cat([keys[1], new[1]], dim=1))
    assert cache.remove_slot(1) is None and cache.n == 1


def test_compaction_drops_the_columns_no_row_uses_and_keeps_every_row():
    cache = BatchKVCache(1, 16)
    src, keys = prefilled([6, 2], seed=2)
    for j, w in enumerate([6, 2]):
        cache.place(cache.add_slot(), src, w, src_row=j, src_start=6 - w)
    cache.remove_slot(0)  # the long row leaves: the short one's 4 leading columns are unused
    assert (cache.length, cache.start_col) == (6, [4])
    cache.compact()
    assert (cache.length, cache.start_col) == (2, [0])
    assert torch.equal(row_keys(cache, 0), keys[1])


def test_misuse_is_refused_naming_the_rows_and_the_end():
    cache = BatchKVCache(1, 4)
    src, _ = prefilled([4], seed=3)
    cache.place(cache.add_slot(), src, 4)
    with pytest.raises(RuntimeError, match="1 rows for 1 slots, end 5 > 4"):
        cache.layers[0].update(torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D))
    with pytest.raises(RuntimeError, match="2 rows for 1 slots"):
        cache.layers[0].update(torch.zeros(2, H, 1, D), torch.zeros(2, H, 1, D))
