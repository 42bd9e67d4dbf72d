"""Supervised fine-tuning on conversations (decoderlab.finetuning.sft): the pipeline's loss against float64,
accumulation and DDP equal one big batch, resume, overfitting eight conversations, truncation and drops, data a
tokenizer cannot represent, and a step with no target."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import lightning as L
import numpy as np
import pytest
import torch
from support.interaction import InterruptAt
from tiny_runs import (ALPHABET, CONVS, DL, TINY_CHAT, chat_pair, conv, one_thread, run_ft,  # noqa: F401
                       tiny_cfg)

from decoderlab.chat import chat_reply, load_model, render_chat, template_from_meta
from decoderlab.checkpoint import load_checkpoint, read_meta
from decoderlab.finetuning import finetune
from decoderlab.finetuning.sft import SFTBatches, build_examples
from decoderlab.training import TrainConfig
from decoderlab.training.rows import IGNORE_INDEX

TINY = TINY_CHAT


def hand_rendered(c, tok):
    """The decoderlab layout built by hand, with the indexes of the supervised tokens."""
    sp = {r: tok.token_to_id[t] for r, t in (("system", "<|system|>"), ("user", "<|user|>"),
                                               ("assistant", "<|assistant|>"), ("end", "<|end|>"))}
    ids, sup = [], []
    for m in c:
        ids.append(sp[m["role"]])
        body = tok.encode(m["content"]) + [sp["end"]]
        if m["role"] == "assistant":
            sup += list(range(len(ids), len(ids) + len(body)))
        ids += body
    return ids, sup


def test_pipeline_loss_equals_float64_per_token_cross_entropy(tmp_path):
    model, tok = chat_pair()
    start = copy.deepcopy(model)
    cfg = tiny_cfg(batch_size=4, accumulate=2)
    _, _, s = run_ft(tmp_path, "a", model, tok, cfg)
    ex = build_examples(CONVS, tok, DL, start.config.max_len)
    rows = SFTBatches(ex.rows, 4, 2, cfg.seed, 0).step_rows(0)
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids, sup = hand_rendered(CONVS[ex.conversations[r]], tok)
            logp = torch.log_softmax(start(torch.tensor(ids[:-1])).double(), -1)
            for t in sup:
                total -= float(logp[t - 1, ids[t]])
                count += 1
    assert s.train_losses[0] == pytest.approx(total / count, rel=1e-6)


class GradCapture(L.Callback):
    def __init__(self):
        self.grads = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()}


def test_accumulation_1x8_equals_4x2_with_uneven_labels(tmp_path):
    model, tok = chat_pair()
    ex = build_examples(CONVS, tok, DL, 48)
    counts = sorted(sum(t != IGNORE_INDEX for t in y) for _, y in ex.rows)
    assert len(set(counts)) > 3  # uneven numbers of supervised tokens per row
    caps, losses = [], []
    for name, b, acc in (("one", 8, 1), ("four", 2, 4)):
        cap = GradCapture()
        _, _, s = run_ft(tmp_path, name, copy.deepcopy(model), tok, tiny_cfg(batch_size=b, accumulate=acc), [cap])
        caps.append(cap.grads)
        losses.append(s.train_losses[0])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for n in caps[0]:
        torch.testing.assert_close(caps[1][n], caps[0][n], rtol=1e-5, atol=1e-7, msg=n)
    # a mean of per-micro-batch means would differ here
    rows = SFTBatches(ex.rows, 2, 4, 42, 0).step_rows(0)
    per = [sum(int(ex_y != IGNORE_INDEX) for r in rows[i:i + 2] for ex_y in ex.rows[r][1]) for i in range(0, 8, 2)]
    assert len(set(per)) > 1


DDP_SCRIPT = """
import sys, torch
sys.path.insert(0, {src!r})
from decoderlab.chat import add_chat_tokens
from decoderlab.finetuning import finetune
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer
from decoderlab.training import TrainConfig
torch.manual_seed(0)
tok = CharTokenizer.from_text({alphabet!r})
model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **{tiny!r}))
model, tok, _ = add_chat_tokens(model, tok, "decoderlab")
cfg = TrainConfig(max_steps=3, batch_size={batch}, accumulate=2, lr=1e-2, warmup=1, eval_every=3, grad_clip=0.0)
finetune({convs!r}, out=sys.argv[1], base_model=(model, tok), train_config=cfg, val_fraction=0, eval_prompts=1,
         eval_max_new_tokens=2, progress_bar=False, logger=False, accelerator="cpu", devices={devices},
         strategy={strategy!r})
"""


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    src = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("DECODERLAB_RUN_DIR", None)
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT).format(src=src, alphabet=ALPHABET, tiny=TINY, batch=1,
                                                         convs=CONVS, devices=2, strategy="ddp"))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ddp")], env=env, capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = {"ddp": json.loads((tmp_path / "ddp" / "summary.json").read_text())}
    # the same run in this process: one process, batch 2 = 2 processes x batch 1
    model, tok = chat_pair(seed=0)
    cfg = TrainConfig(max_steps=3, batch_size=2, accumulate=2, lr=1e-2, warmup=1, eval_every=3, grad_clip=0.0)
    _, _, one = finetune(CONVS, out=tmp_path / "one", base_model=(model, tok), train_config=cfg, val_fraction=0,
                         eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False, accelerator="cpu")
    outs["one"] = one.to_dict()
    assert len(outs["ddp"]["train_losses"]) == 3
    np.testing.assert_allclose(outs["ddp"]["train_losses"], outs["one"]["train_losses"], rtol=1e-5)
    a, _ = load_checkpoint(tmp_path / "ddp")
    b, _ = load_checkpoint(tmp_path / "one")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


def test_resume_continues_with_the_same_batches(tmp_path):
    cfg = tiny_cfg(max_steps=4, batch_size=2, eval_every=2, lr=1e-2)
    model, tok = chat_pair()
    _, _, whole = run_ft(tmp_path, "whole", copy.deepcopy(model), tok, cfg)
    with pytest.raises((SystemExit, KeyboardInterrupt)):  # Ctrl-C at step 3; the last checkpoint is step 2
        run_ft(tmp_path, "part", copy.deepcopy(model), tok, cfg, [InterruptAt(3)])
    _, _, resumed = finetune(CONVS, out=tmp_path / "part", resume=True, train_config=cfg, val_fraction=0,
                             eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False,
                             accelerator="cpu")
    np.testing.assert_allclose(resumed.train_losses, whole.train_losses, rtol=1e-5)


@pytest.mark.slow
def test_overfitting_eight_conversations_reproduces_them_and_stops(overfit):
    out, s = overfit
    model, tok, template, _ = load_model(out)
    assert template == DL
    for c in CONVS:
        info = {}
        assert chat_reply(model, c[:-1], tok, template, temperature=0.0, max_new_tokens=20, info=info) == c[-1]["content"]
        assert info["ended_with_end_of_turn"]
    assert s.evaluation["end_of_turn_rate"] == 1.0 and s.evaluation["exact_match"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluation"]["token_accuracy"] == 1.0 and summary["eval_on"] == "train"
    meta = read_meta(out)
    assert meta["task"] == "chat" and template_from_meta(meta) == DL


def test_long_conversations_truncated_and_counted_none_supervised_is_an_error(tmp_path, capsys):
    model, tok = chat_pair()
    long_reply = conv("hi", "a" * 100)            # truncated: supervised tokens remain
    long_prompt = conv("b" * 60, "ok")            # the reply is beyond max_len: dropped
    ex = build_examples([long_reply, long_prompt, CONVS[0]], tok, DL, 48)
    assert (ex.truncated, ex.dropped, len(ex.rows)) == (2, 1, 2)
    _, _, s = run_ft(tmp_path, "t", model, tok, tiny_cfg(batch_size=2), )
    with pytest.raises(ValueError, match="no supervised token"):
        finetune([long_prompt], out=tmp_path / "n", base_model=chat_pair(), train_config=tiny_cfg(),
                 val_fraction=0, progress_bar=False, logger=False, accelerator="cpu")
    assert not (tmp_path / "n").exists()  # nothing trained, nothing written


def test_tokenizer_that_cannot_represent_the_data_names_the_characters(tmp_path):
    model, tok = chat_pair()
    with pytest.raises(ValueError, match=r"cannot represent 2 characters.*'é' \(U\+00E9\).*'€'"):
        finetune([conv("café", "5 €")], out=tmp_path / "x", base_model=(model, tok), train_config=tiny_cfg(),
                 val_fraction=0, progress_bar=False, logger=False)


# ---------------------------------------------------------------------------------------------------------
# resume keeps the stored run; what it refuses
# ---------------------------------------------------------------------------------------------------------


def test_resume_honours_the_stored_settings(tmp_path):
    """`finetune --resume` rebuilt its TrainConfig from the fine-tuning defaults (500 steps at lr 3e-4) instead
    of the run's: resumed with nothing but the run directory, it continues the stored run to its own end."""
    cfg = tiny_cfg(max_steps=4, batch_size=2, eval_every=2, lr=1e-2)
    model, tok = chat_pair()
    _, _, whole = run_ft(tmp_path, "whole", copy.deepcopy(model), tok, cfg)
    with pytest.raises((SystemExit, KeyboardInterrupt)):  # Ctrl-C at step 3; the last checkpoint is step 2
        run_ft(tmp_path, "part", copy.deepcopy(model), tok, cfg, [InterruptAt(3)])
    _, _, resumed = finetune(CONVS, out=tmp_path / "part", resume=True, eval_prompts=1, eval_max_new_tokens=2,
                             progress_bar=False, logger=False, accelerator="cpu")  # template, config: the run's
    assert resumed.steps == 4 and resumed.template == "decoderlab"
    np.testing.assert_allclose(resumed.train_losses, whole.train_losses, rtol=1e-5)
    info = json.loads((tmp_path / "part" / "run.json").read_text())
    assert info["train_config"] == cfg.to_dict() and info["resumes"][-1]["changed"] == {}
    assert read_meta(tmp_path / "part")["step"] == 4


@pytest.mark.parametrize("change, message", [
    (dict(config_overrides={"seed": 7}), r"with seed=7: the run was trained with seed=42, and seed cannot change"),
    (dict(config_overrides={"accumulate": 2}), r"with accumulate=2: the run was trained with accumulate=1"),
    (dict(template="lesson"), r"with template='lesson': the run was trained with template='decoderlab'"),
    (dict(val_fraction=0.5), r"with val_fraction=0.5: the run was trained with val_fraction=0"),
    (dict(preset="statquest"), r"with preset='statquest': the run was trained with preset=None"),
    (dict(data=CONVS[:4]), r"the conversations differ from those it was fine-tuned on"),
    (dict(tokenizer="bpe"), r"with tokenizer: a resumed run keeps its model and tokenizer"),
])
def test_resume_refuses_what_train_refuses(tmp_path, change, message):
    """What defines the run's data, batches and model cannot change on a resume (as `train --resume`): refused
    before anything is trained, naming the setting."""
    run_ft(tmp_path, "run", *chat_pair(), tiny_cfg(max_steps=2, batch_size=2, eval_every=2))
    before = (tmp_path / "run" / "lightning" / "last.ckpt").read_bytes()
    kw = {"data": CONVS, "eval_prompts": 1, **change}
    with pytest.raises(ValueError, match=rf"^cannot resume {tmp_path / 'run'}.*{message}"):
        finetune(out=tmp_path / "run", resume=True, progress_bar=False, logger=False, accelerator="cpu", **kw)
    assert (tmp_path / "run" / "lightning" / "last.ckpt").read_bytes() == before


# ---------------------------------------------------------------------------------------------------------
# messages that say what happened
# ---------------------------------------------------------------------------------------------------------


def test_a_held_out_share_that_leaves_nothing_to_train_on(tmp_path):
    """`--val-fraction 0.99` said "all 0 conversations have their assistant turns beyond --max-len" when the
    split had left nothing to train on."""
    with pytest.raises(ValueError, match=r"^val_fraction=0\.99 holds out 8 of the 8 conversations and leaves none to "
                                         r"train on; use a smaller val_fraction, or give the held-out"):
        run_ft(tmp_path, "x", *chat_pair(), tiny_cfg(), val_fraction=0.99)
    assert not (tmp_path / "x").exists()
    _, _, s = run_ft(tmp_path, "y", *chat_pair(), tiny_cfg(), val_fraction=0.8)  # 6 of 8 held out: 2 to train on
    assert (s.train_conversations, s.val_conversations, s.eval_on) == (2, 6, "held-out")


def test_no_evaluation_prompts_print_no_nan(tmp_path, capsys):
    """With --eval-prompts 0 fine-tuning printed "end of turn nan%"."""
    model, tok = chat_pair()
    _, _, s = finetune(CONVS, out=tmp_path / "r", base_model=(model, tok), train_config=tiny_cfg(), val_fraction=0,
                       eval_prompts=0, progress_bar="plain", logger=False, accelerator="cpu")
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("fine-tuned for 1 step; train (8 conversations, ") and "nan" not in line, line
    assert line.endswith("; no greedy replies (eval_prompts 0)"), line
    assert s.evaluation["prompts"] == 0 and s.evaluation["end_of_turn_rate"] is None
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["evaluation"]["exact_match"] is None


def test_dropped_conversations_are_not_counted_as_evaluated(tmp_path, capsys):
    """A fine-tune that dropped 6 of 12 conversations (their replies beyond max_len) reported "12
    conversations"."""
    data = CONVS[:6] + [conv("b" * 60, "ok")] * 6  # these six: the reply is beyond max_len 48
    _, _, s = finetune(data, out=tmp_path / "r", base_model=chat_pair(), train_config=tiny_cfg(), val_fraction=0,
                       eval_prompts=2, eval_max_new_tokens=2, progress_bar="plain", logger=False, accelerator="cpu")
    captured = capsys.readouterr()
    assert (s.train_conversations, s.dropped, s.evaluation["conversations"], s.evaluation["dropped"]) == (6, 6, 6, 6)
    assert "train (6 conversations, 6 dropped: no assistant token within max_len, " in captured.out.splitlines()[-1]
    assert "6 with no assistant token left were dropped" in captured.err


def test_held_out_conversations_that_were_all_dropped_print_no_nan(tmp_path, capsys):
    """Held-out conversations with no assistant token within max_len: the evaluation says so (its loss and
    accuracy measured nothing) instead of "loss nan ... token accuracy nan%"."""
    long = [conv("b" * 60, "ok")] * 3  # the replies are beyond max_len 48
    _, _, s = finetune(CONVS, val_data=long, out=tmp_path / "r", base_model=chat_pair(), train_config=tiny_cfg(),
                       eval_prompts=2, progress_bar="plain", logger=False, accelerator="cpu")
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("fine-tuned for 1 step; held-out (0 conversations, 3 dropped: no assistant token within max_len, 0 "
                    "assistant tokens): no loss: no assistant token to score; no greedy replies (no conversation to "
                    "answer)")
    assert s.evaluation["loss"] is None and s.evaluation["token_accuracy"] is None and s.val_conversations == 0


def test_conversations_with_tool_calls_fine_tune_with_the_tools_template(tmp_path):
    """Messages-format data may hold tool calls and their results: a model built from the data (its characters
    include the calls' text) fine-tunes with the "tools" template, which the checkpoint stores, and the
    supervised tokens are the call (after <|tool_call|>) and the final answer."""
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    convs = [[{"role": "user", "content": f"{i} plus 2"}, {"role": "assistant", "content": None, "tool_calls": [
        dict(call, function={"name": "add", "arguments": {"a": i, "b": 2}})]},
        {"role": "tool", "tool_call_id": "c", "content": str(i + 2)}, {"role": "assistant", "content": str(i + 2)}]
        for i in range(8)]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    model, tok, _ = finetune(str(path), out=tmp_path / "r", preset="baby-shakespeare", template="tools",
                             model_overrides=dict(TINY_CHAT, max_len=64), train_config=tiny_cfg(), val_fraction=0,
                             eval_prompts=0, progress_bar=False, logger=False, accelerator="cpu")
    template = template_from_meta(read_meta(tmp_path / "r"))
    assert template.name == "tools" and template.has_tools
    ids, mask = template.render(convs[3], tok)
    supervised = tok.decode([i for i, m in zip(ids, mask) if m])
    assert supervised == '<|tool_call|>add {"a": 3, "b": 2}<|end|>5<|end|>'


def test_a_step_whose_every_target_is_masked_has_a_zero_loss(tmp_path):
    """SFTModule.training_step divided 0 by 0 on a step with no supervised token (NaN: the run stopped); its
    loss is 0, its gradient 0, and the weights stay as they were."""
    from decoderlab.training import make_trainer
    from decoderlab.finetuning.sft import Examples, SFTDataModule, SFTModule
    from decoderlab.training.rows import IGNORE_INDEX

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


def test_fine_tuning_with_a_jinja_template_masks_what_transformers_masks(tmp_path):
    """A Hugging Face chat template with {% generation %} blocks: the supervised targets of every training row
    are transformers' return_assistant_tokens_mask, shifted; the checkpoint stores the template, and the model
    loaded back replies through it, stopping at its <|im_end|>."""
    from hf_chat_templates import CHATML_GENERATION, CHATML_TOKENS, bpe_pair

    from decoderlab.chat import JinjaChatTemplate
    from decoderlab.model import DecoderOnlyTransformer, preset
    from decoderlab.training.rows import shift_for_training

    tok, theirs = bpe_pair(CHATML_TOKENS, chat_template=CHATML_GENERATION)
    template = JinjaChatTemplate(CHATML_GENERATION, name="chatml")
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **dict(TINY, max_len=96)))
    rows = build_examples(CONVS, tok, template, 95).rows
    for c, (x, y) in zip(CONVS, rows):
        out = theirs.apply_chat_template(c, return_assistant_tokens_mask=True)
        assert (x, y) == shift_for_training(out["input_ids"], [bool(m) for m in out["assistant_masks"]], 95)
    _, _, summary = run_ft(tmp_path, "j", model, tok, tiny_cfg(), template=template)
    loaded = load_model(tmp_path / "j")
    assert loaded.template == template and read_meta(tmp_path / "j")["chat_template"]["jinja"] == CHATML_GENERATION
    info = {}
    chat_reply(loaded.model, [{"role": "user", "content": "hi"}], loaded.tokenizer, loaded.template, 8,
               temperature=0, info=info)
    assert info["prompt_ids"] == theirs.apply_chat_template([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=True, return_dict=False)


def test_fine_tuning_from_scratch_with_a_jinja_file_adds_its_tokens_and_characters(tmp_path):
    """`--template chat.jinja` from a preset: the character vocabulary holds the template's own text and its
    control tokens are added; a resume keeps the template."""
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", encoding="utf-8")
    kw = dict(out=tmp_path / "r", preset="baby-shakespeare", model_overrides=dict(TINY_CHAT, max_len=64),
              val_fraction=0, eval_prompts=0, progress_bar=False, logger=False, accelerator="cpu")
    data = [conv("HI", "OK")] * 4
    _, tok, _ = finetune(data, template=str(tmp_path / "chat.jinja"), train_config=tiny_cfg(), **kw)
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok.added_special_tokens) and "y" in tok.token_to_id
    stored = template_from_meta(read_meta(tmp_path / "r"))
    assert stored.name == "jinja:chat.jinja" and stored.end_of_turn(tok) == "<|im_end|>"
    finetune(data, resume=True, train_config=tiny_cfg(max_steps=2),
             **{k: v for k, v in kw.items() if k not in ("preset", "model_overrides")})
    assert template_from_meta(read_meta(tmp_path / "r")) == stored
