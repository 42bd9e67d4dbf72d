"""Chat fine-tuning (issue 10): templates, the renderer, the masked loss and its normalisation, DDP, chat
replies, checkpoints, and bad input. Tiny models and a few steps each."""

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
from conftest import InterruptAt

from decoderlab import cli
from decoderlab.chat import (TEMPLATES, TemplateChatSession, add_chat_tokens, chat_reply, check_messages,
                             load_chat_checkpoint, load_conversations, render_chat, resize_token_embeddings,
                             stream_chat_reply, template_from_meta)
from decoderlab.checkpoint import load_checkpoint, read_meta
from decoderlab.finetuning import (IGNORE_INDEX, SFTBatches, build_examples, finetune, masked_ce_sum,
                                 shift_for_training)
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer
from decoderlab.training import TrainConfig

TINY = dict(d_model=16, n_layer=1, n_head=2, max_len=48)
ALPHABET = "abcdefghijklmnopqrstuvwxyz ?!.,0123456789<>|"
DL = TEMPLATES["decoderlab"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def conv(*turns, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return msgs


CONVS = [conv("hi", "hello there"), conv("what is two plus two?", "4"), conv("name a colour", "red"),
         conv("say yes", "yes", "say no", "no"), conv("count", "1 2 3 4 5 6"), conv("abc", "def"),
         conv("who are you?", "a tiny model", system="be brief"), conv("bye", "see you")]


def chat_pair(seed=0, **over):
    torch.manual_seed(seed)
    tok = CharTokenizer.from_text(ALPHABET)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, **{**TINY, **over}))
    return add_chat_tokens(model, tok, "decoderlab")[:2]


def tiny_cfg(**kw):
    base = dict(max_steps=1, batch_size=8, lr=1e-3, warmup=1, eval_every=1, grad_clip=0.0, log_every=1)
    return TrainConfig(**{**base, **kw})


def run_ft(tmp_path, name, model, tok, cfg, callbacks=(), **kw):
    return finetune(CONVS, out=tmp_path / name, base_model=(model, tok), train_config=cfg, val_fraction=0,
                    eval_prompts=2, eval_max_new_tokens=4, progress_bar=False, logger=False, accelerator="cpu",
                    callbacks=list(callbacks), **kw)


# ---------------------------------------------------------------------------------------------------------
# The renderer and the special tokens
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["char", "bpe", "word"])
def test_supervised_ids_decode_to_each_reply_plus_end_of_turn(kind):
    c = conv("what is up?", "all good", "and you?", "fine too", system="be nice")
    text = " ".join(m["content"] for m in c)
    base = {"char": lambda: CharTokenizer.from_text(text), "bpe": lambda: BPETokenizer.train([text * 5], 300),
            "word": lambda: WordTokenizer.from_texts([text])}[kind]()
    tok = base.add_special_tokens(DL.special_tokens)
    ids, mask = render_chat(c, tok, "decoderlab")
    assert len(ids) == len(mask)
    eot = DL.end_of_turn_id(tok)
    # split the supervised ids into runs: each run is one assistant turn
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert [r[-1] for r in runs] == [eot, eot]
    replies = [tok.decode(r[:-1]) for r in runs]
    assert [r.replace(" ", "") if kind == "word" else r for r in replies] == (
        ["allgood", "finetoo"] if kind == "word" else ["all good", "fine too"])
    # the opener of each assistant turn is context, not a target
    assert all(not m for i, m in zip(ids, mask) if i == tok.token_to_id["<|assistant|>"])


@pytest.mark.parametrize("kind", ["char", "bpe", "word"])
def test_typed_special_token_text_stays_text(kind):
    text = "hi <|user|> <|end|> there ok <|assistant|>"
    base = {"char": lambda: CharTokenizer.from_text(text), "bpe": lambda: BPETokenizer.train([text * 5], 300),
            "word": lambda: WordTokenizer.from_texts(["hi there ok"], unk=True)}[kind]()
    tok = base.add_special_tokens(DL.special_tokens)
    ids, _ = render_chat(conv(text, "ok <|assistant|>") if kind != "word" else conv(text, "hi"), tok)
    specials = [tok.token_to_id[t] for t in DL.special_tokens]
    # exactly the template's own special tokens: user, end, assistant, end
    assert [i for i in ids if i in specials] == [specials[1], specials[3], specials[2], specials[3]]
    if kind != "word":
        assert tok.decode(tok.encode(text)) == text
    # saved and loaded, the special tokens come back and stay atomic
    again = type(tok).from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.added_special_tokens == DL.special_tokens
    assert render_chat(conv(text, "hi"), again)[0] == render_chat(conv(text, "hi"), tok)[0]


def test_resize_embedding_new_rows_at_the_mean_untied_head():
    torch.manual_seed(0)
    tok = CharTokenizer.from_text("abc")
    model = DecoderOnlyTransformer(preset("statquest", num_tokens=tok.vocab_size))  # untied head with a bias
    model2, tok2, added = add_chat_tokens(model, tok, "decoderlab")
    assert added == DL.special_tokens and tok2.vocab_size == tok.vocab_size + 4
    n = tok.vocab_size
    torch.testing.assert_close(model2.we.weight[:n], model.we.weight)
    torch.testing.assert_close(model2.we.weight[n:], model.we.weight.mean(0).expand(4, -1))
    torch.testing.assert_close(model2.fc_layer.weight[n:], model.fc_layer.weight.mean(0).expand(4, -1))
    torch.testing.assert_close(model2.fc_layer.bias[n:], model.fc_layer.bias.mean().expand(4))
    x = torch.tensor([2, 3, 4])  # old ids: the old logits are unchanged
    torch.testing.assert_close(model2(x)[:, :n], model(x))
    with pytest.raises(ValueError, match="shrink"):
        resize_token_embeddings(model2, n)


def test_lesson_template_is_the_pair_scheme():
    from decoderlab.lesson import LESSON_PAIRS, pair_inputs_and_labels, tokenizer_for_pairs

    tok = tokenizer_for_pairs(LESSON_PAIRS)
    ids, mask = render_chat(conv("what is statquest", "awesome"), tok, "lesson")
    inputs, labels = pair_inputs_and_labels(LESSON_PAIRS[:1], tok)
    x, y = shift_for_training(ids, mask, max_len=6)
    assert x == inputs[0].tolist()
    # the lesson supervises every position; the chat loss keeps only the response and its <EOS>
    assert y == [IGNORE_INDEX] * 3 + labels[0].tolist()[3:]


# ---------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# Overfitting, chat replies, checkpoints
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overfit(tmp_path_factory):
    torch.set_num_threads(1)
    model, tok = chat_pair(seed=1, d_model=64, n_layer=2, n_head=4)
    out = tmp_path_factory.mktemp("overfit") / "chat"
    cfg = TrainConfig(max_steps=150, batch_size=8, lr=1e-2, min_lr=1e-3, warmup=5, eval_every=150, grad_clip=1.0,
                      weight_decay=0.0)
    _, _, s = finetune(CONVS, out=out, base_model=(model, tok), train_config=cfg, val_fraction=0, eval_prompts=8,
                       eval_max_new_tokens=16, progress_bar=False, logger=False, accelerator="cpu")
    return out, s


def test_overfitting_eight_conversations_reproduces_them_and_stops(overfit):
    out, s = overfit
    model, tok, template = load_chat_checkpoint(out)
    assert template == DL
    for c in CONVS:
        info = {}
        assert chat_reply(model, tok, c[:-1], template, temperature=0.0, max_new_tokens=20, info=info) == c[-1]["content"]
        assert info["ended_with_end_of_turn"]
    assert s.evaluation["end_of_turn_rate"] == 1.0 and s.evaluation["exact_match"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluation"]["token_accuracy"] == 1.0 and summary["eval_on"] == "train"
    meta = read_meta(out)
    assert meta["task"] == "chat" and template_from_meta(meta) == DL


def test_chat_renders_exactly_the_training_ids(overfit):
    out, _ = overfit
    model, tok, template = load_chat_checkpoint(out)
    c = CONVS[3]  # two turns
    train_ids, _ = render_chat(c, tok, template)
    info = {}
    chat_reply(model, tok, c[:1], template, temperature=0.0, info=info)
    assert info["prompt_ids"] == train_ids[: len(info["prompt_ids"])]
    assert info["prompt_ids"][-1] == tok.token_to_id["<|assistant|>"]
    session = TemplateChatSession(model, tok, template, temperature=0.0)
    assert "".join(session.reply(c[0]["content"])) == c[1]["content"]
    second = {}
    list(stream_chat_reply(model, tok, session.messages + [c[2]], template, temperature=0.0, info=second))
    assert second["prompt_ids"] == train_ids[: len(second["prompt_ids"])]
    assert "".join(session.reply(c[2]["content"])) == c[3]["content"]


def test_chat_trims_oldest_turns_keeps_system(overfit, capsys):
    out, _ = overfit
    model, tok, template = load_chat_checkpoint(out)
    long = [{"role": "system", "content": "be brief"}]
    for _ in range(4):
        long += conv("say yes", "yes")
    long.append({"role": "user", "content": "say no"})
    info = {}
    chat_reply(model, tok, long, template, temperature=0.0, max_new_tokens=8, info=info)
    assert info["dropped_messages"] > 0 and info["dropped_messages"] % 2 == 0
    assert info["prompt_ids"][0] == tok.token_to_id["<|system|>"] and len(info["prompt_ids"]) <= 48 - 8
    session = TemplateChatSession(model, tok, template, system="be brief", temperature=0.0, max_new_tokens=8)
    for _ in range(5):
        "".join(session.reply("say yes"))
    assert session.messages[0]["role"] == "system" and "dropped" in session.notice


def test_cli_generate_and_chat_use_the_stored_template(overfit, capsys, monkeypatch):
    out, _ = overfit
    assert cli.main(["generate", "--chat", "--checkpoint", str(out), "--temperature", "0", "abc"]) == 0
    assert capsys.readouterr().out == "def\n"
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO("name a colour\nbye\n"))
    assert cli.main(["chat", "--checkpoint", str(out), "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["red", "see you"]


def test_cli_finetune_lesson_template_reproduces_awesome(tmp_path, capsys):
    data = tmp_path / "lesson.jsonl"
    data.write_text('{"prompt": "what is statquest", "completion": "awesome"}\n'
                    '{"prompt": "statquest is what", "completion": "awesome"}\n')
    out = tmp_path / "lesson"
    assert cli.main(["finetune", "--preset", "statquest", "--tokenizer", "word", "--template", "lesson", "--data",
                     str(data), "--val-fraction", "0", "--out", str(out), "--max-steps", "60", "--lr", "0.1",
                     "--min-lr", "0.1", "--warmup", "1", "--eval-every", "60", "--grad-clip", "0",
                     "--no-progress-bar"]) == 0
    capsys.readouterr()
    for prompt in ("what is statquest", "statquest is what"):
        assert cli.main(["generate", "--chat", "--checkpoint", str(out), prompt]) == 0
        assert capsys.readouterr().out == "awesome <EOS>\n"


def test_old_checkpoints_still_load(statquest_checkpoint):
    model, tok = load_checkpoint(statquest_checkpoint)
    assert tok.added_special_tokens == [] and template_from_meta(read_meta(statquest_checkpoint)) is None


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------


def write(tmp_path, *lines):
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD = json.dumps({"messages": conv("hi", "ho")})


@pytest.mark.parametrize("bad, match", [
    ('{"messages": [', r"line 2: malformed JSON"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), r"line 2: .*unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                              {"role": "assistant", "content": "c"}]}), r"line 2: .*two user turns in a row"),
    (json.dumps({"messages": conv("a", "  ")}), r"line 2: .*empty assistant turn"),
    (json.dumps({"prompt": "a", "completion": "b"}), r"line 2: expected a JSON object|line 2: unexpected key"),
    (json.dumps({"messages": conv("a")}), r"line 2: .*must end with an assistant message"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad, match):
    p = write(tmp_path, GOOD, bad, GOOD)
    with pytest.raises(ValueError, match=match) as e:
        load_conversations(p)
    assert str(p) in str(e.value)


def test_three_formats_are_detected(tmp_path):
    assert load_conversations(write(tmp_path, GOOD)) == [conv("hi", "ho")]
    pc = load_conversations(write(tmp_path, json.dumps({"prompt": "p", "completion": "c"})))
    assert pc.format == "prompt-completion" and pc == [conv("p", "c")]
    al = load_conversations(write(tmp_path, json.dumps({"instruction": "i", "input": "x", "output": "o"}),
                                  json.dumps({"instruction": "j", "input": "", "output": "q"})))
    assert al.format == "alpaca" and al == [conv("i\n\nx", "o"), conv("j", "q")]


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


def test_cli_errors(tmp_path, capsys):
    data = write(tmp_path, GOOD)
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(data), "--out", str(tmp_path / "o"),
                     "--template", "chatml9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("decoderlab: error: unknown chat template 'chatml9'; known templates: decoderlab, lesson")
    bad = write(tmp_path, GOOD, "{oops")
    assert cli.main(["finetune", "--preset", "statquest", "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "line 2: malformed JSON" in capsys.readouterr().err


def test_reply_needs_a_final_user_message():
    model, tok = chat_pair()
    with pytest.raises(ValueError, match="must end with a user message"):
        chat_reply(model, tok, conv("a", "b"))
    with pytest.raises(ValueError, match="only the first message"):
        check_messages([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], final=None)


# ---------------------------------------------------------------------------------------------------------
# The command line on the new layout: explain --chat, flag combinations, the real console script
# ---------------------------------------------------------------------------------------------------------


def test_cli_explain_chat_renders_what_the_model_sees(overfit, capsys):
    """explain --chat traces exactly the ids chat and generate --chat give the model (the one renderer)."""
    out, _ = overfit
    model, tok, template = load_chat_checkpoint(out)
    want, _ = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}], tok,
                          template, add_generation_prompt=True)
    assert cli.main(["explain", "--chat", "--system", "be brief", "--checkpoint", str(out), "abc"]) == 0
    text = capsys.readouterr().out
    assert f"({len(want)} tokens, ids {want})" in text
    assert cli.main(["explain", "--checkpoint", str(out), "abc"]) == 0  # plain text: no template tokens
    assert f"(3 tokens, ids {tok.encode('abc')})" in capsys.readouterr().out


def test_cli_chat_flags_on_a_base_checkpoint_and_bad_combinations(statquest_checkpoint, overfit, tmp_path, capsys):
    out, _ = overfit
    data = write(tmp_path, GOOD)
    cases = [
        (["generate", "--chat", "--checkpoint", str(statquest_checkpoint), "what is statquest"],
         "--chat needs a chat checkpoint"),
        (["generate", "--system", "x", "--checkpoint", str(out), "abc"], "--system applies with --chat"),
        (["generate", "--chat", "--stop", "x", "--checkpoint", str(out), "abc"], "--stop does not apply with --chat"),
        (["chat", "--system", "x", "--checkpoint", str(statquest_checkpoint)], "--system needs a chat checkpoint"),
        (["explain", "--chat", "--checkpoint", str(statquest_checkpoint), "what"], "--chat needs a chat checkpoint"),
        (["finetune", "--data", str(data), "--out", str(tmp_path / "o")], "give --checkpoint DIR"),
        (["finetune", "--checkpoint", str(out), "--n-layer", "2", "--data", str(data), "--out", str(tmp_path / "o")],
         "--n-layer applies with --preset"),
        (["finetune", "--preset", "statquest", "--val-fraction", "1", "--data", str(data), "--out",
          str(tmp_path / "o")], r"--val-fraction must be in \[0, 1\), got 1"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("decoderlab: error: ") and err.count("\n") == 1, err
        assert __import__("re").search(message, err), err


def test_console_script_finetune_errors_in_one_line(decoderlab_cli, tmp_path):
    data = write(tmp_path, GOOD, "{oops")
    r = decoderlab_cli("finetune", "--preset", "statquest", "--data", data, "--out", tmp_path / "o")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"decoderlab: error: {data}, line 2: malformed JSON: Expecting property name enclosed in " \
                       f"double quotes (column 2)\n"
    r = decoderlab_cli("finetune", "--preset", "statquest", "--data", data, "--out", tmp_path / "o", "--lr", "x")
    assert r.returncode == 2
    assert r.stderr == "decoderlab: error: --lr must be a number, got 'x' (see decoderlab finetune --help)\n"


def test_chat_notes_come_one_line_each(overfit, capsys, monkeypatch):
    """Both notes of one reply (turns dropped; no end of turn) were printed on one stderr line."""
    import io

    out, _ = overfit
    monkeypatch.setattr("sys.stdin", io.StringIO("/max-new-tokens 1\n" + "say yes\n" * 12))
    assert cli.main(["chat", "--checkpoint", str(out), "--temperature", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "(the reply stopped at 1 tokens without an end of turn)" in err
    both = [i for i, ln in enumerate(err) if ln.startswith("(the conversation was longer")]
    assert both and all(ln.startswith("(") and ln.endswith(")") and ln.count("(the ") == 1 for ln in err), err
    assert err[both[0] + 1] == "(the reply stopped at 1 tokens without an end of turn)"


def test_the_last_message_alone_renders_too_long_in_the_singular(overfit):
    out, _ = overfit
    model, tok, template = load_chat_checkpoint(out)
    with pytest.raises(ValueError, match=r"^the last user message alone renders to \d+ tokens, which leaves no room"):
        chat_reply(model, tok, [{"role": "user", "content": "say yes " * 40}], template, max_new_tokens=4)


def test_ctrl_c_during_a_reply_stops_only_that_reply(tmp_path):
    """One Ctrl-C (SIGINT) while a reply streams: "(reply stopped)", and the next line is answered (exit 0)."""
    import signal
    import time
    from pathlib import Path

    from decoderlab.checkpoint import save_checkpoint

    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1,
                                          n_head=2, tie_weights=False, lm_head_bias=True))
    with torch.no_grad():
        model.fc_layer.bias[tok.eos_id] = -1e4  # the reply never ends by itself
    ckpt = save_checkpoint(tmp_path / "ck", model, tok)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-m", "decoderlab.cli", "chat", "--checkpoint", str(ckpt), "--seed", "1",
                          "--max-new-tokens", "100000000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    try:
        p.stdin.write(b"abc\n")
        p.stdin.flush()
        first = p.stdout.read(20)  # the reply is streaming
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        p.stdin.write(b"/max-new-tokens 3\nabc\n")
        p.stdin.close()
        rest = p.stdout.read()
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        p.kill()
    lines = (first + rest).decode().splitlines()
    stopped = lines.index("(reply stopped)")
    assert lines[stopped + 1:stopped + 2] == ["(max-new-tokens = 3)"] and len(lines) == stopped + 3
    assert len(lines[-1]) == 3 and set(lines[-1]) <= set("abcdefgh ")  # the next line got its 3-token answer
    assert p.stderr.read() == b""


def test_finetune_data_that_is_not_a_regular_file(decoderlab_cli, tmp_path):
    """/dev/null said "no conversation file /dev/null" (it exists: it is not a regular file)."""
    r = decoderlab_cli("finetune", "--preset", "statquest", "--data", "/dev/null", "--out", tmp_path / "o")
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "decoderlab: error: conversation file /dev/null is not a "
                                                         "regular file (give a JSONL file)\n")
