"""Masked rows (decoderlab.training.rows): after the one label shift only the assistant's tokens are targets (the
masked sum ignores a change in the user's text and follows one in the assistant's)."""

import torch
from tiny_runs import chat_pair, conv, one_thread  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import render_chat
from decoderlab.training.rows import masked_ce_sum, shift_for_training


def test_user_target_change_keeps_the_loss_assistant_change_changes_it():
    model, tok = chat_pair()
    c = conv("hello", "world")
    ids, mask = render_chat(c, tok)
    x, _ = shift_for_training(ids, mask, 48)
    logits = model(torch.tensor([x])).detach()

    def loss(target_ids):
        _, y = shift_for_training(target_ids, mask, 48)
        ce, n = masked_ce_sum(logits, torch.tensor([y]))
        return float(ce / n)

    base = loss(ids)
    user_pos = 2  # inside "hello"
    assistant_pos = ids.index(tok.token_to_id["<|assistant|>"]) + 2  # inside "world"
    for pos, same in ((user_pos, True), (assistant_pos, False), (len(ids) - 1, False)):  # last: <|end|>
        changed = list(ids)
        changed[pos] = tok.token_to_id["z"]
        assert (loss(changed) == base) is same, pos


def _rows(lengths):
    return [([1] * n, [1] * n) for n in lengths]


def test_group_by_length_sees_every_row_once_per_epoch_with_little_padding():
    import numpy as np

    from decoderlab.training.rows import StepBatches

    rng = np.random.default_rng(0)
    lengths = rng.choice([20, 22, 24, 60, 110], size=1003, p=[.3, .3, .3, .05, .05])
    plain = StepBatches(_rows(lengths), 8, 2, 7, 0)
    grouped = StepBatches(_rows(lengths), 8, 2, 7, 0, group_by_length=True)
    steps = len(lengths) // 16
    seen = np.concatenate([grouped.step_rows(s) for s in range(steps)])
    assert len(set(seen.tolist())) == len(seen) == steps * 16  # one epoch: no row twice
    pad = lambda b: sum(lengths[b.step_rows(s)].max() * 16 for s in range(steps))  # noqa: E731
    real = lengths[seen].sum()
    assert pad(grouped) < 1.15 * real < pad(plain) / 1.5
    # the next epoch is another order, and the grouping is deterministic for a seed
    assert not np.array_equal(grouped.step_rows(steps + 1), grouped.step_rows(1))
    again = StepBatches(_rows(lengths), 8, 2, 7, 0, group_by_length=True)
    assert np.array_equal(again.step_rows(5), grouped.step_rows(5))


def test_group_by_length_steps_are_the_same_for_every_split():
    import numpy as np

    from decoderlab.training.rows import StepBatches

    lengths = np.random.default_rng(1).integers(5, 90, size=500)
    a = StepBatches(_rows(lengths), 2, 4, 3, 0, group_by_length=True)  # 1 process x accumulate 4 x batch 2
    b = StepBatches(_rows(lengths), 8, 1, 3, 0, group_by_length=True)  # 1 x 1 x 8
    c = StepBatches(_rows(lengths), 4, 1, 3, 0, rank=1, world_size=2, group_by_length=True)  # 2 x 1 x 4
    for s in (0, 7, 70):
        assert np.array_equal(a.step_rows(s), b.step_rows(s)) and np.array_equal(b.step_rows(s), c.step_rows(s))


def test_group_by_length_must_be_a_bool():
    import pytest

    from decoderlab.training import TrainConfig

    with pytest.raises(ValueError, match="group_by_length must be True or False, got 'yes'"):
        TrainConfig(group_by_length="yes")


def _packable_rows():
    """Three rows with a common system-prompt prefix (no targets in it) and different lengths and targets."""
    prefix = [1, 2, 3, 4, 5]
    rows = []
    for k, (body, answer) in enumerate((([6, 7], [8, 9, 10]), ([7], [11, 12]), ([6, 9, 9, 8], [13]))):
        ids = prefix + body + answer + [14]
        mask = [False] * (len(prefix) + len(body)) + [True] * (len(answer) + 1)
        rows.append(shift_for_training(ids, mask, 64))
    return rows


def test_a_packed_micro_batch_scores_and_trains_as_the_padded_one():
    """pack_rows + segment_mask + select: the logits of every target and the gradients equal the padded batch's
    (float64, a rope + GQA model: positions and the shared prefix must be right for this to hold)."""
    from decoderlab.lora import apply_lora
    from decoderlab.model import DecoderOnlyTransformer, preset
    from decoderlab.training.rows import IGNORE_INDEX, collate, pack_rows, segment_mask, shared_prefix

    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=16, d_model=32, n_layer=2, n_head=4,
                                          n_kv_head=2, max_len=64, position="rope", mlp="swiglu", norm="rmsnorm",
                                          dropout=0.0)).double()
    apply_lora(model, 2, init=False)
    rows = _packable_rows()
    assert shared_prefix(rows) == 5
    x, y = collate(rows, 0)
    padded = model(x)[y != IGNORE_INDEX]
    padded_ce = torch.nn.functional.cross_entropy(padded, y[y != IGNORE_INDEX], reduction="sum")
    grads = torch.autograd.grad(padded_ce, [p for p in model.parameters() if p.requires_grad])
    # one packed row of the 5 shared tokens and the rest; two: the rows of 10 (6 in common) and the row of 8
    for capacity, shape in ((64, (1, 5 + sum(len(r[0]) - 5 for r in rows))), (22, (2, 6 + 4 + 4))):
        px, py, positions, segments, targets = pack_rows(rows, 0, capacity)
        assert px.shape == shape and len(targets) == int((y != IGNORE_INDEX).sum())
        packed = model(px, positions=positions, attn_mask=segment_mask(segments), select=targets)
        ce = torch.nn.functional.cross_entropy(packed, py.reshape(-1)[targets], reduction="sum")
        torch.testing.assert_close(ce, padded_ce, rtol=1e-12, atol=0)
        for g, h in zip(torch.autograd.grad(ce, [p for p in model.parameters() if p.requires_grad]), grads):
            torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)


def test_no_prefix_is_shared_over_a_target_or_a_whole_row():
    from decoderlab.training.rows import IGNORE_INDEX, shared_prefix

    assert shared_prefix([([1, 2, 3], [IGNORE_INDEX, 5, 6])]) == 0  # one row: nothing to share
    assert shared_prefix([([1, 2, 3], [IGNORE_INDEX, 5, 6]), ([1, 2, 3], [IGNORE_INDEX, 5, 6])]) == 1  # a target
    assert shared_prefix([([1, 2], [IGNORE_INDEX] * 2), ([1, 2, 4], [IGNORE_INDEX] * 3)]) == 1  # a row kept its own


def test_the_loss_in_row_slices_equals_the_loss_of_all_the_logits_and_so_do_its_gradients():
    """chunked_ce_sum through forward(head=...): the summed cross-entropy, the correct count and the adapters'
    gradients of slices of 3 rows (recomputed in the backward pass; or, the output layer frozen as under LoRA, taken
    in the forward pass) equal those of one (K, V) logits tensor, in float64 to 1e-12; no row at all keeps a graph
    (a step of no target)."""
    from decoderlab.lora import apply_lora
    from decoderlab.model import DecoderOnlyTransformer, preset
    from decoderlab.training.rows import IGNORE_INDEX, chunked_ce_sum, collate

    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=16, d_model=32, n_layer=2, n_head=4,
                                          max_len=64, dropout=0.0)).double()
    apply_lora(model, 2, init=False)
    x, y = collate(_packable_rows(), 0)
    flat = y.reshape(-1)
    select = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    labels = flat[select]
    trained = [p for p in model.parameters() if p.requires_grad]
    logits = model(x, select=select)
    whole = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    grads = torch.autograd.grad(whole, trained)
    for rows, frozen in ((3, False), (3, True), (1, True), (len(labels) + 5, False)):
        ce, correct = model(x, select=select, head=lambda f, h: chunked_ce_sum(f, h, labels, rows=rows, accuracy=True,
                                                                               frozen=frozen))
        torch.testing.assert_close(ce, whole, rtol=1e-12, atol=0)
        assert int(correct) == int((logits.argmax(-1) == labels).sum())
        for g, h in zip(torch.autograd.grad(ce, trained), grads):
            torch.testing.assert_close(g, h, rtol=1e-10, atol=1e-12)
    none = torch.zeros(0, dtype=torch.long)
    ce, correct = model(x, select=none, head=lambda f, h: chunked_ce_sum(f, h, none, rows=3))
    assert float(ce.detach()) == 0 and ce.requires_grad and correct is None
