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
