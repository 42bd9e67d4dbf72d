"""Masked SFT: only the assistant's tokens are targets (the loss ignores a change in the user's text and follows
one in the assistant's)."""

import torch
from tiny_runs import chat_pair, conv, one_thread  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import render_chat
from decoderlab.training.sft import masked_ce_sum, shift_for_training


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


def test_a_step_whose_every_target_is_masked_has_a_zero_loss(tmp_path):
    """SFTModule.training_step divided 0 by 0 on a step with no supervised token (NaN: the run stopped); its
    loss is 0, its gradient 0, and the weights stay as they were."""
    import copy

    from decoderlab.training import TrainConfig, make_trainer
    from decoderlab.training.sft import IGNORE_INDEX, Examples, SFTDataModule, SFTModule

    model, tok = chat_pair()
    start = copy.deepcopy(model)
    ids, _ = render_chat(conv("hello", "world"), tok)
    rows = [(ids[:-1], [IGNORE_INDEX] * (len(ids) - 1))] * 2  # every label masked
    ex = Examples(rows, [0, 1], 0, 0, 0)
    cfg = TrainConfig(max_steps=1, batch_size=2, warmup=1, eval_every=1, weight_decay=0.0, grad_clip=0.0)
    module = SFTModule(model, cfg)
    trainer = make_trainer(cfg, None, accelerator="cpu", progress_bar=False, logger=False, checkpointing=False)
    trainer.fit(module, datamodule=SFTDataModule(ex, None, batch_size=2, accumulate=1, seed=0, pad_id=0))
    assert module.losses == [0.0]
    for (name, p), q in zip(model.state_dict().items(), start.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
