"""GPT-2 in and out (decoderlab.hf.gpt2, through the shared loader and writer): same logits as Hugging Face,
round trips, and bad inputs.

Everything is built locally from a small random GPT2LMHeadModel; nothing is downloaded.
"""

import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import decoderlab as dl  # noqa: E402
from decoderlab.cli import main as cli_main  # noqa: E402
from decoderlab.hf import from_hf, to_hf  # noqa: E402

SMALL = dict(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None)


def small_gpt2(seed=0, **overrides) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**{**SMALL, **overrides})).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to 0/1: make every tensor matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def hf_model():
    return small_gpt2()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 100, (3, 32), generator=g)


@pytest.mark.parametrize("hf_attention", ["eager", "sdpa"])
@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
def test_logits_equal_hugging_face(hf_model, ids, kernel, hf_attention):
    hf_model.set_attn_implementation(hf_attention)
    assert hf_model.config._attn_implementation == hf_attention
    ref = logits(hf_model, ids)
    ours = from_hf(hf_model, attention=kernel)
    assert ours.config.attention == kernel and not ours.training
    for t in (1, 7, 32):
        diff = (logits(ours, ids[:, :t]) - ref[:, :t]).abs().max().item()
        assert diff < 1e-5, (kernel, hf_attention, t, diff)
    assert ref.abs().max() > 0.1  # the comparison is not between near-zero logits


def test_config_mapping(hf_model):
    m = from_hf(hf_model)
    c = m.config
    assert (c.num_tokens, c.d_model, c.n_layer, c.n_head, c.max_len, c.ff_size) == (100, 64, 2, 4, 32, 256)
    assert (c.position, c.norm, c.mlp, c.bias, c.tie_weights, c.lm_head_bias, c.attn_out_proj) == (
        "learned", "layernorm", "gelu", True, True, False, True)
    assert m.fc_layer.weight is m.we.weight
    assert torch.equal(m.blocks[1].attention.qkv.weight, hf_model.transformer.h[1].attn.c_attn.weight.t())


def test_round_trip_ours_to_hf_directory_to_ours(tmp_path, ids):
    torch.manual_seed(3)
    cfg = dl.preset("gpt2", num_tokens=100, d_model=64, n_layer=2, n_head=4, max_len=32, d_ff=96, norm_eps=1e-6)
    ours = dl.DecoderOnlyTransformer(cfg).eval()
    hf = to_hf(ours, tmp_path / "gpt2-small-copy", attn_implementation="eager")
    assert isinstance(hf, GPT2LMHeadModel)
    files = {p.name for p in (tmp_path / "gpt2-small-copy").iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "gpt2-small-copy").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert {"config.json", "model.safetensors"} <= files
    written = json.loads((tmp_path / "gpt2-small-copy" / "config.json").read_text())
    assert (written["n_inner"], written["layer_norm_epsilon"], written["n_embd"]) == (96, 1e-6, 64)
    assert (logits(hf, ids) - logits(ours, ids)).abs().max().item() < 1e-5
    back = from_hf(tmp_path / "gpt2-small-copy", attention=cfg.attention)
    assert back.config == cfg.replace(init="gpt2")
    assert torch.equal(logits(back, ids), logits(ours, ids))
    # writing again replaces the directory
    to_hf(back, tmp_path / "gpt2-small-copy")
    assert torch.equal(logits(from_hf(tmp_path / "gpt2-small-copy"), ids), logits(ours, ids))


def test_bias_free_and_untied_models_export(tmp_path):
    torch.manual_seed(4)
    ours = dl.DecoderOnlyTransformer("baby-shakespeare", n_layer=2, tie_weights=False).eval()
    assert not ours.config.bias
    ids = torch.randint(0, 65, (2, 64))
    hf = to_hf(ours, tmp_path / "baby").eval()
    assert not hf.config.tie_word_embeddings
    assert torch.count_nonzero(hf.transformer.h[0].attn.c_attn.bias) == 0
    assert (logits(hf, ids) - logits(ours, ids)).abs().max().item() < 1e-5
    back = from_hf(tmp_path / "baby")
    assert back.config.bias and not back.config.tie_weights
    assert back.fc_layer.weight is not back.we.weight
    assert torch.equal(logits(back, ids), logits(ours, ids))


def test_untied_hugging_face_model(ids):
    hf = small_gpt2(seed=5, tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    for source in (hf, hf.state_dict()):
        ours = from_hf(source, n_head=4)
        assert not ours.config.tie_weights
        assert (logits(ours, ids) - logits(hf, ids)).abs().max().item() < 1e-5


def test_from_state_dict_with_and_without_prefix(hf_model, ids):
    ref = logits(hf_model, ids)
    full = hf_model.state_dict()
    bare = hf_model.transformer.state_dict()  # GPT2Model names: "h.0...", no lm_head
    assert any(k.startswith("transformer.h.0.") for k in full) and "h.0.ln_1.weight" in bare
    # the causal-mask buffers of older transformers versions are ignored
    old_style = {**full, "transformer.h.0.attn.bias": torch.ones(1, 1, 32, 32, dtype=torch.bool),
                 "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}
    for state in (full, bare, old_style):
        ours = from_hf(state, n_head=4)
        assert (ours.config.n_layer, ours.config.max_len, ours.config.ff_size) == (2, 32, 256)
        assert (logits(ours, ids) - ref).abs().max().item() < 1e-5
    with_config = from_hf(full, config=hf_model.config)
    assert torch.equal(logits(with_config, ids), logits(from_hf(full, n_head=4), ids))
    with_dict = from_hf(full, config=hf_model.config.to_dict(), attention="explicit")
    assert (logits(with_dict, ids) - ref).abs().max().item() < 1e-5


def test_from_directory_with_pytorch_model_bin_and_shards(tmp_path, hf_model, ids):
    ref = logits(hf_model, ids)
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(hf_model.config.to_json_string())
    torch.save(hf_model.state_dict(), d / "pytorch_model.bin")
    assert (logits(from_hf(d), ids) - ref).abs().max().item() < 1e-5
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert (logits(from_hf(str(sharded)), ids) - ref).abs().max().item() < 1e-5


# ------------------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------------------

_GPT = dict(num_tokens=50, d_model=32, n_layer=1, n_head=2, max_len=16)


@pytest.mark.parametrize("field,value", [
    ("position", "rope"), ("position", "sinusoidal"), ("position", "none"),
    ("norm", "rmsnorm"), ("norm", "none"), ("mlp", "none"),
    ("attn_out_proj", False), ("lm_head_bias", True),
])
def test_to_hf_refuses_what_no_class_computes(tmp_path, field, value):
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", **_GPT, **{field: value}))
    with pytest.raises(ValueError, match=rf"{field}={value!r}"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_to_hf_rejects_the_lesson_model():
    with pytest.raises(ValueError, match="position='sinusoidal'"):
        to_hf(dl.DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6))


def test_missing_tensor_is_named(hf_model):
    state = dict(hf_model.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"missing tensor 'transformer\.h\.1\.mlp\.c_fc\.bias' \(shape \(256,\)\)"):
        from_hf(state, n_head=4)


def test_misshaped_tensor_is_named(hf_model):
    state = dict(hf_model.state_dict())
    state["transformer.h.0.attn.c_attn.weight"] = state["transformer.h.0.attn.c_attn.weight"].t()
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn\.c_attn\.weight' has shape \(192, 64\), but state "
                                         r"dict gives it \(64, 192\)"):
        from_hf(state, n_head=4)
    state = dict(hf_model.state_dict())
    state["transformer.ln_f.bias"] = torch.zeros(63)
    with pytest.raises(ValueError, match=r"'transformer\.ln_f\.bias' has shape \(63,\), but state dict gives it \(64,\)"):
        from_hf(state, config=hf_model.config)


def test_unexpected_tensor_and_missing_size_tensor(hf_model):
    state = {**hf_model.state_dict(), "transformer.h.0.attn.q_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"unexpected tensor.*h\.0\.attn\.q_proj\.weight"):
        from_hf(state, n_head=4)
    state = {k: v for k, v in hf_model.state_dict().items() if k != "transformer.wte.weight"}
    with pytest.raises(ValueError, match="missing tensor 'wte.weight'"):
        from_hf(state, n_head=4)


def test_state_dict_needs_n_head(hf_model):
    with pytest.raises(ValueError, match="n_head cannot be inferred"):
        from_hf(hf_model.state_dict())
    with pytest.raises(ValueError, match="n_head=8 contradicts the config's n_head=4"):
        from_hf(hf_model.state_dict(), config=hf_model.config, n_head=8)
    with pytest.raises(ValueError, match="divisible by n_head"):
        from_hf(hf_model.state_dict(), n_head=5)


def test_tied_config_with_different_lm_head(hf_model):
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from the embedding, but state dict ties them"):
        from_hf(state, config=hf_model.config)


def test_directory_errors_name_the_directory(tmp_path, hf_model):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    (empty / "config.json").write_text(hf_model.config.to_json_string())
    with pytest.raises(FileNotFoundError, match=r"no-weights has no weights file.*model\.safetensors"):
        from_hf(empty)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    with pytest.raises(FileNotFoundError, match="no-config has no config.json"):
        from_hf(no_config)
    with pytest.raises(FileNotFoundError, match="does-not-exist does not exist"):
        from_hf(tmp_path / "does-not-exist")


@pytest.mark.parametrize("option,value,match", [
    ("activation_function", "relu", "activation_function 'relu'"),
    ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=True"),
    ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn=True"),
    ("scale_attn_weights", False, "scale_attn_weights=False"),
    ("architectures", ["GPTNeoXForCausalLM"], r"architectures \['GPTNeoXForCausalLM'\] is not a class decoderlab "
                                              "reads; allowed: GPT2LMHeadModel"),
])
def test_gpt2_options_we_do_not_implement(hf_model, option, value, match):
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(ValueError, match=match):
        from_hf(hf_model.state_dict(), config=config)


def test_wrong_source_type():
    with pytest.raises(TypeError, match="got int"):
        from_hf(42)
    with pytest.raises(TypeError, match="not a tensor"):
        from_hf({"wte.weight": [1, 2]}, n_head=1)
    with pytest.raises(TypeError, match="DecoderOnlyTransformer"):
        to_hf(torch.nn.Linear(2, 2))


def test_missing_transformers_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'decoderlab\[hf\]'"):
        to_hf(dl.DecoderOnlyTransformer(dl.preset("gpt2", **_GPT)))


def test_to_hf_never_deletes_foreign_files(tmp_path):
    from decoderlab.hf import to_hf

    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", n_layer=1, n_head=2, d_model=16, num_tokens=20, max_len=8))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to replace.*keep.txt"):
        to_hf(model, mine)
    assert (mine / "keep.txt").read_text() == "mine"
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError, match="it is a file"):
        to_hf(model, afile)
    to_hf(model, tmp_path / "out")
    to_hf(model, tmp_path / "out")  # a directory of its own files may be replaced
    assert (tmp_path / "out" / "config.json").is_file()


# ---------------------------------------------------------------------------------------------------------
# Hugging Face GPT-2 directories are checkpoints too
# ---------------------------------------------------------------------------------------------------------

CORPUS = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
          "arrows of outrageous fortune, or to take arms against a sea of troubles.\n") * 4


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained here (GPT-2's scheme, a small vocabulary)."""
    from decoderlab.tokenizers import BPETokenizer

    return BPETokenizer.train(CORPUS, 300)


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory, bpe):
    """A randomly initialised GPT-2 in Hugging Face layout, with the tokenizer as vocab.json + merges.txt
    ("files"), without a tokenizer ("bare"), and written by to_hf with the tokenizer ("exported")."""
    root = tmp_path_factory.mktemp("hf-dirs")
    hf = small_gpt2(vocab_size=bpe.vocab_size)
    for name in ("files", "bare"):
        hf.save_pretrained(root / name)
    bpe.hf_tokenizer.model.save(str(root / "files"))  # vocab.json, merges.txt: as GPT2Tokenizer's files
    to_hf(from_hf(hf), root / "exported", tokenizer=bpe)
    return hf, root


def test_the_one_loader_reads_a_gpt2_directory(gpt2_dirs, bpe):
    from decoderlab.chat import load_model

    hf, root = gpt2_dirs
    text = "whether 'tis nobler \u00e9t\u00e9 \U0001F600"
    for name in ("files", "exported"):
        model, tok, template, meta = load_model(root / name)
        assert template is None and meta == {}
        assert tok.encode(text) == bpe.encode(text) and tok.decode(tok.encode(text)) == text
        ids = torch.tensor([tok.encode(text)])
        assert (logits(model, ids) - logits(hf, ids)).abs().max().item() < 1e-5
    assert {p.name for p in (root / "exported").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                                "vocab.json", "merges.txt"}
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in (root / "exported").iterdir()} == {
        p.name: 0o666 & ~umask for p in (root / "exported").iterdir()}  # model.safetensors too, not 0600


def test_checkpoint_reader_reads_both_formats_as_the_one_loader(gpt2_dirs, statquest_checkpoint):
    """hf.checkpoint_reader picks the format's reader; what it reads is what the one loader (chat.load_model)
    gives, for a GPT-2 directory and a decoderlab checkpoint."""
    from decoderlab.chat import load_model
    from decoderlab.hf import checkpoint_reader

    _, root = gpt2_dirs
    for where in (root / "files", statquest_checkpoint):
        model, tok = checkpoint_reader(where)(where)
        loaded = load_model(where)
        ids = torch.tensor([[1, 2, 3]])
        assert tok.to_dict() == loaded.tokenizer.to_dict()
        assert torch.equal(logits(model, ids), logits(loaded.model, ids))



def test_cli_commands_take_a_gpt2_directory(gpt2_dirs, bpe, decoderlab_cli, capsys):
    """generate and chat through the console script; verify and explain in this process (a process each saved)."""
    hf, root = gpt2_dirs
    model = from_hf(root / "files")
    want = bpe.decode(dl.generate(model, bpe.encode("To be"), 8, seed=1, tokenizer=bpe))
    r = decoderlab_cli("generate", "--checkpoint", root / "files", "--no-stream", "--seed", "1", "--max-new-tokens", "8",
                       "To be")
    assert (r.returncode, r.stdout, r.stderr) == (0, want + "\n", "")
    assert cli_main(["verify", "--checkpoint", str(root / "exported"), "To be, or not"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[-1].endswith("all ok")
    assert cli_main(["explain", "--checkpoint", str(root / "files"), "To be, or not"]) == 0
    assert "=> the top next token after" in capsys.readouterr().out
    r = decoderlab_cli("chat", "--checkpoint", root / "files", "--seed", "1", "--max-new-tokens", "3", stdin="To be\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1
    assert r.stderr.startswith(f"({root / 'files'} has no chat template: each line continues the text so far")


def test_gpt2_directory_without_tokenizer_says_what_is_missing(gpt2_dirs, capsys):
    _, root = gpt2_dirs
    assert cli_main(["generate", "--checkpoint", str(root / "bare"), "To be"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    bare = root / "bare"
    assert err == (f"decoderlab: error: {bare} has weights but no tokenizer: it needs "
                        "tokenizer.json, or vocab.json and merges.txt (vocab.json and merges.txt missing). Copy the "
                        "tokenizer files of the model next to its weights, or load the weights alone in Python with "
                        f"decoderlab.hf.from_hf({str(bare)!r}) and a tokenizer of your own\n")


def test_exported_directory_round_trips_through_auto_tokenizer_and_generate(tmp_path, bpe):
    """Hugging Face reads an export as decoderlab wrote it: AutoTokenizer gives our ids for the same text (no
    default <|endoftext|> added past the vocabulary), and generate stops at the model's <EOS>."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    ours = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=bpe.vocab_size, d_model=32, n_layer=2, n_head=4,
                                               max_len=32)).eval()
    prompt = bpe.encode("To be, or")
    eos_at = len(prompt) + 2  # from this position on the residual is the <EOS> row: the 4th new token is <EOS>
    with torch.no_grad():
        ours.pe.weight[eos_at:] += 100 * ours.we.weight[bpe.eos_id]
    to_hf(ours, tmp_path / "export", tokenizer=bpe)
    files = {p.name for p in (tmp_path / "export").iterdir()}
    assert {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"} <= files

    tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert len(tok) == bpe.vocab_size == 300
    assert (tok.eos_token_id, tok.pad_token_id) == (bpe.eos_id, bpe.pad_id)
    for text in ("whether 'tis nobler \u00e9t\u00e9 \U0001F600", "x<|endoftext|>y", "a <EOS> b", "To be, or"):
        assert tok(text)["input_ids"] == bpe.encode(text), text
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert (hf.config.eos_token_id, hf.generation_config.eos_token_id) == (bpe.eos_id, bpe.eos_id)
    logits(hf, torch.tensor([tok("x<|endoftext|>y")["input_ids"]]))  # every id is inside the vocabulary

    want = dl.generate(ours, prompt, 10, temperature=0, tokenizer=bpe)  # stops at <EOS>, which it does not return
    assert len(want) == 3
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
    assert out[0].tolist() == prompt + want + [bpe.eos_id]  # Hugging Face keeps the end token, and stops there
