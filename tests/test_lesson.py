"""The lessons' building blocks, numbers and task (issue: foundation)."""

import math
import re

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab.cli import main as cli_main

LESSON_X = [[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]]
LESSON_OUT = [[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]]


def test_self_attention_reproduces_the_lesson_numbers():
    torch.manual_seed(42)
    sa = dl.SelfAttention(d_model=2, row_dim=0, col_dim=1)
    out = sa(torch.tensor(LESSON_X))
    assert torch.allclose(out, torch.tensor(LESSON_OUT), atol=5e-5)
    assert [tuple(w.weight.shape) for w in (sa.W_q, sa.W_k, sa.W_v)] == [(2, 2)] * 3
    assert all(w.bias is None for w in (sa.W_q, sa.W_k, sa.W_v))


def test_defaults_are_the_lessons():
    sa = dl.SelfAttention()
    assert (sa.d_model, sa.row_dim, sa.col_dim) == (2, 0, 1)
    pe = dl.PositionEncoding()
    assert tuple(pe.pe.shape) == (6, 2)
    m = dl.DecoderOnlyTransformer()
    assert (m.config.num_tokens, m.config.d_model, m.config.max_len) == (4, 2, 6)
    opt = m.configure_optimizers()
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["lr"] == 0.1
    assert isinstance(m.loss, torch.nn.CrossEntropyLoss)


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_checked_by_hand_in_float64(masked):
    """Recompute every step in float64 NumPy from the extracted weights, as the lesson validates by hand."""
    torch.manual_seed(0)
    cls = dl.Attention if masked else dl.SelfAttention
    mod = cls(d_model=3).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    mask = torch.tril(torch.ones(5, 5)) == 0
    # torch, step by step, float64
    q, k, v = mod.W_q(x), mod.W_k(x), mod.W_v(x)
    sims = q @ k.T
    scaled = sims / math.sqrt(3)
    if masked:
        scaled = scaled.masked_fill(mask, -1e9)
    percents = torch.softmax(scaled, dim=1)
    out = mod(x, x, x, mask=mask) if masked else mod(x)
    # NumPy, from the weights (nn.Linear computes x @ W.T)
    X = x.numpy()
    Wq, Wk, Wv = (w.weight.detach().numpy() for w in (mod.W_q, mod.W_k, mod.W_v))
    Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T
    S = Q @ K.T
    SS = S / np.sqrt(K.shape[1])
    if masked:
        SS = np.where(mask.numpy(), -1e9, SS)
    P = _softmax(SS)
    O = P @ V
    for name, ours, ref in [("Q", q, Q), ("K", k, K), ("V", v, V), ("sims", sims, S), ("scaled", scaled, SS),
                            ("percents", percents, P), ("output", out, O)]:
        assert np.abs(ours.detach().numpy() - ref).max() <= 1e-6, name
    if masked:  # the first token sees only itself
        assert P[0, 1:].max() < 1e-12 and abs(P[0, 0] - 1) < 1e-12


def test_attention_does_encoder_decoder_attention():
    torch.manual_seed(1)
    att = dl.Attention(d_model=2)
    q_in, kv_in = torch.randn(3, 2), torch.randn(5, 2)
    out = att(q_in, kv_in, kv_in)
    assert out.shape == (3, 2)
    ref = torch.softmax(att.W_q(q_in) @ att.W_k(kv_in).T / math.sqrt(2), dim=1) @ att.W_v(kv_in)
    assert torch.allclose(out, ref, atol=1e-6)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:, 3:] = True
    ref_short = att(q_in, kv_in[:3], kv_in[:3])
    assert torch.allclose(att(q_in, kv_in, kv_in, mask=mask), ref_short, atol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: dl.SelfAttention(d_model=3),
    lambda: (lambda a: (lambda x: a(x, x, x, mask=torch.tril(torch.ones(4, 4)) == 0)))(dl.Attention(d_model=3)),
    lambda: dl.PositionEncoding(d_model=3, max_len=6),
])
def test_blocks_batched_equal_unbatched(make):
    torch.manual_seed(3)
    f = make()
    xb = torch.randn(3, 4, 3)
    yb = f(xb)
    for i in range(3):
        assert torch.allclose(yb[i], f(xb[i]), atol=1e-6)


def test_model_batched_equal_unbatched_and_shapes():
    torch.manual_seed(0)
    m = dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    ids = torch.tensor([[0, 1, 2, 4, 3], [2, 1, 0, 4, 3]])
    out = m(ids)
    assert out.shape == (2, 5, 5)
    assert m(ids[0]).shape == (5, 5)
    for i in range(2):
        assert torch.allclose(out[i], m(ids[i]), atol=1e-6)


def test_statquest_model_is_the_lessons_model():
    """Same seed -> the same weights and logits as the lesson's code built from Attention/PositionEncoding."""
    torch.manual_seed(42)
    m = dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    assert m.num_parameters() == 37
    torch.manual_seed(42)
    we = torch.nn.Embedding(5, 2)
    pe = dl.PositionEncoding(d_model=2, max_len=6)
    att = dl.Attention(d_model=2)
    fc = torch.nn.Linear(2, 5)
    ids = torch.tensor([0, 1, 2, 4])
    x = pe(we(ids))
    mask = torch.tril(torch.ones(4, 4)) == 0
    ref = fc(att(x, x, x, mask=mask) + x)
    assert torch.allclose(m(ids), ref, atol=1e-6)


def test_position_encoding_matches_the_formula():
    for d_model, max_len in [(2, 3), (4, 6), (5, 7), (6, 10)]:
        pe = dl.PositionEncoding(d_model=d_model, max_len=max_len).pe
        for pos in range(max_len):
            for j in range(d_model):
                i2 = j - (j % 2)
                angle = pos / 10000 ** (i2 / d_model)
                want = math.sin(angle) if j % 2 == 0 else math.cos(angle)
                assert abs(float(pe[pos, j]) - want) < 1e-6
    # the lesson's worked values: d_model 4, position 0 -> [0, 1, 0, 1]
    assert dl.PositionEncoding(d_model=4, max_len=2).pe[0].tolist() == [0.0, 1.0, 0.0, 1.0]
    x = torch.zeros(3, 2)
    assert torch.equal(dl.PositionEncoding(2, 6)(x), dl.PositionEncoding(2, 6).pe[:3])


def test_lesson_inputs_and_labels():
    tok = dl.lesson_tokenizer()
    assert tok.token_to_id == {"what": 0, "is": 1, "statquest": 2, "awesome": 3, "<EOS>": 4}
    inputs, labels = dl.pair_inputs_and_labels(dl.LESSON_PAIRS, tok)
    assert [tok.decode(r.tolist()) for r in inputs] == ["what is statquest <EOS> awesome",
                                                      "statquest is what <EOS> awesome"]
    assert [tok.decode(r.tolist()) for r in labels] == ["is statquest <EOS> awesome <EOS>",
                                                      "is what <EOS> awesome <EOS>"]
    assert dl.tokenizer_for_pairs(dl.LESSON_PAIRS).token_to_id == tok.token_to_id


def test_pairs_of_different_lengths_are_padded_and_ignored():
    pairs = [("a", "b"), ("a b c", "d")]
    tok = dl.tokenizer_for_pairs(pairs)
    assert tok.pad_id is not None
    inputs, labels = dl.pair_inputs_and_labels(pairs, tok)
    assert inputs.shape == labels.shape == (2, 5)
    assert tok.decode(inputs[0].tolist()) == "a <EOS> b <PAD> <PAD>"
    assert labels[0].tolist()[:3] == tok.encode("<EOS> b <EOS>") and labels[0].tolist()[3:] == [-100, -100]
    assert tok.decode(inputs[1].tolist()) == "a b c <EOS> d"
    # the loss ignores the padded labels: it is the mean over the 3 + 5 real labels
    torch.manual_seed(0)
    m = dl.DecoderOnlyTransformer(num_tokens=tok.vocab_size, d_model=4, max_len=8)
    loss = m.compute_loss((inputs, labels))
    f = torch.nn.functional.cross_entropy
    ref = (f(m(inputs[0])[:3], labels[0][:3], reduction="sum") + f(m(inputs[1]), labels[1], reduction="sum")) / 8
    assert torch.allclose(loss, ref, atol=1e-6)
    with pytest.raises(ValueError, match="<PAD>"):
        dl.pair_inputs_and_labels(pairs, dl.WordTokenizer(["a", "b", "c", "d"]))


def test_trained_statquest_answers_awesome(statquest_checkpoint):
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    assert model.num_parameters() == 37
    for prompt in ("what is statquest", "statquest is what"):
        ids = tok.encode(prompt + " <EOS>")
        assert tok.decode(dl.greedy_response(model, ids, tok.eos_id)) == "awesome <EOS>"


def test_cli_generate_appends_eos(statquest_checkpoint, capsys):
    for prompt in ("what is statquest", "statquest is what", "what is statquest <EOS>"):
        assert cli_main(["generate", "--checkpoint", str(statquest_checkpoint), prompt]) == 0
        assert capsys.readouterr().out.strip() == "awesome <EOS>"


# ---- bad input -------------------------------------------------------------------------------------------


def test_token_ids_out_of_range():
    m = dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    with pytest.raises(ValueError, match=r"token id 5 .*0 \.\. 4"):
        m(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="token id -1"):
        m(torch.tensor([-1, 0]))


def test_sequence_longer_than_max_len():
    m = dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)
    with pytest.raises(ValueError, match="T=7.*max_len=6"):
        m(torch.zeros(7, dtype=torch.long))
    with pytest.raises(ValueError, match="T=7.*max_len=6"):
        dl.PositionEncoding(2, 6)(torch.zeros(7, 2))


def test_mask_that_cannot_broadcast():
    att = dl.Attention(d_model=2)
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"mask of shape \(4, 4\).*\(3, 3\)"):
        att(x, x, x, mask=torch.zeros(4, 4, dtype=torch.bool))


def test_wrong_last_dimension():
    with pytest.raises(ValueError, match="last dimension 3.*d_model is 2"):
        dl.SelfAttention(d_model=2)(torch.randn(4, 3))
    with pytest.raises(ValueError, match="last dimension 3.*d_model is 2"):
        dl.Attention(d_model=2)(torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 2))
    with pytest.raises(ValueError, match="last dimension 3.*d_model is 2"):
        dl.PositionEncoding(d_model=2)(torch.randn(4, 3))


def test_unknown_word():
    tok = dl.lesson_tokenizer()
    with pytest.raises(KeyError, match="'hello'"):
        tok.encode("what is hello")
    assert dl.WordTokenizer(["a"], unk=True).encode("a zzz") == [0, 2]


def test_greedy_response_requires_eos_in_the_library(statquest_checkpoint):
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    with pytest.raises(ValueError, match="must end with <EOS>"):
        dl.greedy_response(model, tok.encode("what is statquest"), tok.eos_id)


def test_checkpoint_missing_or_incomplete(tmp_path, statquest_checkpoint, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dl.load_checkpoint(tmp_path / "nope")
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "nope"), "what"]) == 2
    assert "does not exist" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((statquest_checkpoint / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="missing model.safetensors, tokenizer.json"):
        dl.load_checkpoint(broken)
    assert cli_main(["generate", "--checkpoint", str(broken), "what"]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_lesson_classes_reject_bad_sizes():
    for bad in (0, -2, "2", 2.0):
        with pytest.raises(ValueError, match="d_model must be a positive integer"):
            dl.SelfAttention(d_model=bad)
        with pytest.raises(ValueError, match="d_model must be a positive integer"):
            dl.Attention(d_model=bad)


def test_train_refuses_an_out_directory_with_other_files(tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("important")
    assert cli_main(["train", "--preset", "statquest", "--out", str(precious)]) == 2
    assert "refusing to replace" in capsys.readouterr().err and "thesis.txt" in str(list(precious.iterdir()))
    assert (precious / "thesis.txt").read_text() == "important"
    with pytest.raises(FileExistsError, match="it is a file"):
        dl.save_checkpoint(precious / "thesis.txt", dl.DecoderOnlyTransformer(num_tokens=5), dl.lesson_tokenizer())


def test_statquest_training_rejects_language_model_options(capsys):
    assert cli_main(["train", "--preset", "statquest", "--data", "x.txt", "--max-steps", "3"]) == 2
    assert "--data, --max-steps apply to language-model presets only" in capsys.readouterr().err


def test_pair_generation_rejects_sampling_options(statquest_checkpoint, capsys):
    assert cli_main(["generate", "--checkpoint", str(statquest_checkpoint), "--temperature", "0.5", "what"]) == 2
    assert "--temperature does not apply" in capsys.readouterr().err


def test_corrupt_checkpoint_files_are_named(tmp_path, statquest_checkpoint, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(statquest_checkpoint, bad)
    weights = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(weights[:100])
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        dl.load_checkpoint(bad)
    (bad / "model.safetensors").write_bytes(weights)
    (bad / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json is not a valid ModelConfig JSON file"):
        dl.load_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match="is a file"):
        dl.load_checkpoint(bad / "config.json")
    assert cli_main(["generate", "--checkpoint", str(bad), "what"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_sample_keeps_word_separators(statquest_checkpoint, capsys):
    assert cli_main(["sample", "--checkpoint", str(statquest_checkpoint), "what is",
                     "--max-new-tokens", "3", "--seed", "1"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["what", "is"] and len(words) == 5
    assert set(words) <= set(dl.lesson_tokenizer().token_to_id)


def test_out_directory_with_foreign_files_of_checkpoint_names_is_refused(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}')
    assert cli_main(["train", "--preset", "statquest", "--out", str(mine)]) == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (mine / "config.json").read_text() == '{"mine": true}'


def test_verify_failure_prints_an_error_line(statquest_checkpoint, capsys):
    assert cli_main(["verify", "--checkpoint", str(statquest_checkpoint), "--tol", "1e-12", "what is statquest"]) == 1
    assert "decoderlab: error: verify failed" in capsys.readouterr().err


def test_corrupt_tokenizer_and_meta_are_named(tmp_path, statquest_checkpoint):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(statquest_checkpoint, bad)
    (bad / "meta.json").write_text("{oops")
    with pytest.raises(ValueError, match="meta.json is not a valid JSON file"):
        dl.load_checkpoint(bad)
    shutil.copy(statquest_checkpoint / "meta.json", bad / "meta.json")
    (bad / "tokenizer.json").write_text("")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizer JSON file"):
        dl.load_checkpoint(bad)


@pytest.mark.slow
def test_cli_train_statquest_says_what_it_learned(tmp_path, decoderlab_cli):
    """`decoderlab train --preset statquest`: the final loss and whether both lesson prompts answer "awesome"."""
    out = tmp_path / "sq"
    r = decoderlab_cli("train", "--preset", "statquest", "--out", out)
    assert (r.returncode, r.stderr) == (0, "")  # no Lightning banners
    lines = r.stdout.splitlines()
    assert re.fullmatch(r"trained the lesson's model \(37 parameters\) for 30 epochs on its two pairs: final loss "
                        r"0\.\d{4} \(mean cross-entropy over both pairs\)", lines[0]), lines[0]
    assert lines[1:] == ['  "what is statquest" -> awesome', '  "statquest is what" -> awesome',
                         f'both lesson prompts are answered "awesome"; checkpoint written to {out}']
    (tmp_path / "notes.txt").write_text("mine")
    r = decoderlab_cli("train", "--preset", "statquest", "--out", "notes.txt", cwd=tmp_path)
    assert (r.returncode, r.stderr) == (2, "decoderlab: error: --out notes.txt is a file, not a directory\n")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lesson_attention_with_a_mask_works_in_half_precision(dtype):
    """The lesson's -1e9 fill does not fit in float16 (it raised a torch overflow error): float32 inside."""
    torch.manual_seed(42)
    attention = dl.Attention(d_model=2, row_dim=0, col_dim=1)
    x = torch.tensor([[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]])
    mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), diagonal=1)
    want = attention(x, x, x, mask=mask)
    got = attention.to(dtype)(x.to(dtype), x.to(dtype), x.to(dtype), mask=mask)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=3e-2)


def test_new_runs_never_overwrite_a_checkpoint_or_other_files(statquest_checkpoint, tmp_path, decoderlab_cli, capsys):
    """The newcomer's data loss: `train --preset statquest --out runs/statquest`, then `train --data mytext.txt ...
    --out runs/statquest` (or `finetune ... --out` the same folder) replaced the lesson's checkpoint with rc 0."""
    import json
    import shutil

    from decoderlab.finetuning import finetune
    from decoderlab.training import train_lm, train_pairs

    out = tmp_path / "runs" / "statquest"
    shutil.copytree(statquest_checkpoint, out)
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    mytext = tmp_path / "mytext.txt"
    mytext.write_text("to be or not to be, that is the question\n" * 40, encoding="utf-8")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "ho"}]}) + "\n", encoding="utf-8")
    want = (f"decoderlab: error: {out} already holds a training run (lightning/last.ckpt); continue it with --resume "
            f"{out}, or train into another --out directory\n")
    r = decoderlab_cli("train", "--preset", "statquest", "--out", out)  # the console script's line
    assert (r.returncode, r.stdout, r.stderr) == (2, "", want)
    for argv in (("train", "--data", mytext, "--max-steps", "5", "--out", out),  # (in this process: ~10 s each saved)
                 ("finetune", "--preset", "statquest", "--data", chats, "--max-steps", "2", "--out", out)):
        assert cli_main([str(a) for a in argv]) == 2, argv
        assert capsys.readouterr() == ("", want), argv
    with pytest.raises(FileExistsError, match="already holds a training run .*another --out"):
        train_pairs(out=out)
    with pytest.raises(FileExistsError, match="already holds a training run"):
        train_lm(mytext, preset="baby-shakespeare", out=out, config_overrides={"max_steps": 1})
    with pytest.raises(FileExistsError, match="already holds a training run"):
        finetune(chats, preset="statquest", out=out, config_overrides={"max_steps": 1})
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing lost
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"it already holds files \(notes.md\)"):
        train_pairs(out=other)
    assert [p.name for p in other.iterdir()] == ["notes.md"]
