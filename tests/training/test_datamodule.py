"""A language model's batches: random windows (shifted, deterministic, split over ranks), validation windows
(each target once, over processes too), and the datamodule's resume (decoderlab.training.datamodule over
decoderlab.data's windows)."""

import numpy as np
import pytest
import torch

from decoderlab.data import RandomWindowBatches, SequentialWindows, window_offsets
from decoderlab.training import TokenDataModule


def test_windows_are_shifted_deterministic_and_split_over_ranks(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16)
    path = tmp_path / "tokens.u16"
    tokens.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")[100:4000]  # a view into the file, as split_tokens gives
    whole = RandomWindowBatches(mm, max_len=8, batch_size=6, seed=7)
    for k in (0, 1, 57):
        x, y = whole[k]
        assert x.dtype == torch.int64 and x.shape == (6, 8)
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y, x + 1)  # consecutive ids: targets shifted
        starts = window_offsets(7, k, 6, len(mm) - 8) + 100
        assert torch.equal(x[:, 0], torch.from_numpy(starts))
        # 2 ranks with batch 3 take the two halves of the same global batch
        halves = [RandomWindowBatches(mm, 8, 3, 7, rank=r, world_size=2)[k][0] for r in (0, 1)]
        assert torch.equal(torch.cat(halves), x)
    assert not torch.equal(whole[0][0], whole[1][0])
    assert torch.equal(RandomWindowBatches(mm, 8, 6, seed=8)[0][0], RandomWindowBatches(mm, 8, 6, seed=8)[0][0])
    # a pickled dataset (a DataLoader worker) re-opens the file instead of carrying the data
    import pickle

    blob = pickle.dumps(whole)
    assert len(blob) < 2000
    assert torch.equal(pickle.loads(blob)[57][0], whole[57][0])


def test_validation_windows_cover_the_split_once():
    val = torch.arange(1, 102)  # 101 tokens, max_len 10 -> 10 windows predicting tokens 2..101
    ds = SequentialWindows(val.numpy(), max_len=10, batch_size=4)
    xs, ys = zip(*(ds[j] for j in range(len(ds))))
    assert len(ds) == 3 and [len(x) for x in xs] == [4, 4, 2]
    assert torch.equal(torch.cat(xs).flatten(), val[:100]) and torch.equal(torch.cat(ys).flatten(), val[1:101])
    assert len(SequentialWindows(val.numpy(), 10, 4, max_batches=2)) == 2


def test_datamodule_resumes_where_it_stopped():
    tokens = np.arange(3000, dtype=np.int64)
    dm = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=3)
    it = iter(dm.train_dataloader())
    first = [next(it)[0] for _ in range(5)]
    dm2 = TokenDataModule(tokens[:2500], tokens[2500:], max_len=8, batch_size=4, seed=0)
    dm2.load_state_dict({"seed": 3, "batches_served": 3, "batch_size": 4, "max_len": 8})
    it2 = iter(dm2.train_dataloader())
    assert torch.equal(next(it2)[0], first[3]) and torch.equal(next(it2)[0], first[4])


@pytest.mark.parametrize("n_train, n_val", [(5, 100), (100, 5)])
def test_split_shorter_than_a_window(n_train, n_val):
    with pytest.raises(ValueError, match=rf"train {n_train}, validation {n_val} tokens"):
        TokenDataModule(np.zeros(n_train, np.int64), np.zeros(n_val, np.int64), max_len=8, batch_size=2)


def test_validation_windows_split_over_processes_like_one_process():
    tokens = np.arange(1000, dtype=np.int64)

    def targets(ds):
        return [int(t) for j in range(len(ds)) for t in ds[j][1].flatten()]

    for batch_size, max_batches in [(4, None), (4, 3), (1, None), (64, 1), (5, 2)]:
        whole = SequentialWindows(tokens, 10, batch_size, max_batches)
        for world in (2, 3, 5):
            parts = [SequentialWindows(tokens, 10, batch_size, max_batches, rank, world) for rank in range(world)]
            assert all(len(p) >= 1 for p in parts)
            assert all(len(x) <= batch_size for p in parts for j in range(len(p)) for x in [p[j][0]])
            assert sorted(t for p in parts for t in targets(p)) == targets(whole)
    with pytest.raises(ValueError, match="the validation set has 2 windows of max_len\\+1 = 11 tokens for 3 processes"):
        SequentialWindows(tokens, 10, batch_size=1, max_batches=2, rank=2, world_size=3)
