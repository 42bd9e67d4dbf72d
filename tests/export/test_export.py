"""decoderlab.export.to_gguf, the command's GGUF half over decoderlab.gguf.save_gguf: a shape no llama.cpp
architecture computes refused naming the option, nothing written; the chat template written as Jinja with its end
of turn, read back as the built-in template; an ollama Modelfile beside the file, kept without force; a GGUF file
read and written again keeps its template, pre-tokenizer and tensors. (The writer's tensors, dtypes and
tokenizer: tests/gguf/test_writer.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab.export import ExportShapeError, check_shape, to_gguf
from decoderlab.tokenizers import BPETokenizer

from support.gguf_files import field, read_back

gguf = pytest.importorskip("gguf")

TEXT = open(dl.embedded_corpus_path(), encoding="utf-8").read()[:20_000]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXT, 400)


def gpt2_model(num_tokens: int, seed: int = 0, **overrides) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(seed)
    shape = dict(n_layer=2, n_head=2, d_model=64, max_len=48, num_tokens=num_tokens, **overrides)
    return dl.DecoderOnlyTransformer(dl.preset("gpt2", **shape)).eval()


@pytest.mark.parametrize("overrides,option", [
    (dict(position="rope"), "--position rope"), (dict(norm="rmsnorm"), "--norm rmsnorm"),
    (dict(mlp="relu2"), "--mlp relu2"), (dict(qk_norm=True), "ModelConfig.qk_norm"),
])
def test_a_shape_llama_cpp_gpt2_cannot_carry_is_refused_naming_the_option(bpe, tmp_path, overrides, option):
    model = gpt2_model(bpe.vocab_size, **overrides)
    with pytest.raises(ExportShapeError, match="--format gguf writes the models a llama.cpp architecture computes "
                                               "exactly .*the nearest is gpt2") as e:
        to_gguf(model, bpe, tmp_path / "x.gguf")
    assert option in str(e.value) and e.value.field == next(iter(overrides))
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_default_recipe_is_refused_naming_every_field_at_once():
    """No llama.cpp architecture computes the speedrun's model (LayerNorm with rope, a ReLU² MLP): refused against
    the nearest, the llama family, naming both fields."""
    with pytest.raises(ExportShapeError) as e:
        check_shape(dl.preset("baby-shakespeare-speedrun"), "gguf")
    assert ("the nearest is llama / qwen2 / qwen3, where they use RMSNorm; their blocks have a SwiGLU MLP"
            in str(e.value))
    assert str(e.value).endswith("this model has norm='layernorm' (--norm layernorm), mlp='relu2' (--mlp relu2)")
    assert e.value.field == "norm" and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown export format 'onnx'; allowed: hf, gguf"):
        check_shape(dl.preset("gpt2"), "onnx")


def test_the_modelfile_is_written_beside_and_kept_without_force(bpe, tmp_path):
    model = gpt2_model(bpe.vocab_size)
    summary = to_gguf(model, bpe, tmp_path / "m.gguf")
    assert summary["modelfile"] == str(tmp_path / "m.Modelfile") and "FROM ./m.gguf" in (tmp_path / "m.Modelfile").read_text()
    (tmp_path / "m.gguf").unlink()
    before = (tmp_path / "m.Modelfile").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to replace .*m.Modelfile: it exists"):
        to_gguf(model, bpe, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and (tmp_path / "m.Modelfile").read_bytes() == before  # nothing written
    to_gguf(model, bpe, tmp_path / "m.gguf", force=True)
    assert (tmp_path / "m.gguf").is_file()
    assert to_gguf(model, bpe, tmp_path / "n.gguf", modelfile=False)["modelfile"] is None
    assert not (tmp_path / "n.Modelfile").exists()


def test_the_chat_template_and_its_end_of_turn_are_in_the_file(bpe, tmp_path):
    from decoderlab.chat import TEMPLATES, add_chat_tokens, chat_template_jinja, load_model

    model, tok, _ = add_chat_tokens(gpt2_model(bpe.vocab_size), bpe, "decoderlab")
    to_gguf(model, tok, tmp_path / "chat.gguf", template=TEMPLATES["decoderlab"])
    _, fields = read_back(tmp_path / "chat.gguf")
    assert field(fields, "tokenizer.chat_template") == chat_template_jinja(TEMPLATES["decoderlab"], tok)
    assert field(fields, "tokenizer.ggml.eot_token_id") == tok.token_to_id["<|end|>"]
    loaded = load_model(tmp_path / "chat.gguf")
    assert loaded.template == TEMPLATES["decoderlab"]  # the built-in template, recognised
    messages = [{"role": "user", "content": "Who are you?"}]
    assert loaded.template.render(messages, loaded.tokenizer, add_generation_prompt=True)[0] == \
        TEMPLATES["decoderlab"].render(messages, tok, add_generation_prompt=True)[0]


def test_export_of_a_gguf_file_keeps_its_jinja_template_and_pre_tokenizer(tmp_path):
    """A GGUF file (llama.cpp's converter's layout, SmolLM's digit split, a ChatML Jinja template) read and
    written again: the same tokenizer fields, template and -- in float32 -- the same tensors."""
    pytest.importorskip("transformers")
    from support.gguf_files import CHATML, byte_level_bpe, hf_model, write_gguf

    from decoderlab.chat import load_model

    src_tok = byte_level_bpe(300, pre="smollm")
    src = write_gguf(tmp_path / "src.gguf", "llama", hf_model("llama", src_tok.get_vocab_size()), src_tok,
                     pre="smollm")
    model, tok, template, _ = load_model(src)
    to_gguf(model, tok, tmp_path / "out.gguf", template=template)
    a, fa = read_back(src)
    b, fb = read_back(tmp_path / "out.gguf")
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.chat_template"):
        assert field(fa, key) == field(fb, key), key
    assert field(fb, "tokenizer.chat_template") == CHATML and field(fb, "tokenizer.ggml.pre") == "smollm"
    assert set(a) == set(b)
    for name in a:
        assert np.array_equal(a[name][1], b[name][1]), name
    modelfile = (tmp_path / "out.Modelfile").read_text()
    assert "FROM ./out.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


@pytest.mark.parametrize("kind", ["missing", "plain file", "empty directory"])
def test_export_of_a_path_that_is_no_checkpoint_gives_the_front_door_s_one_message(tmp_path, kind):
    """The library's export names a bad path as ``decoderlab.load`` does (one message for every command), not
    with the reader of one kind's complaint; nothing is written."""
    import decoderlab as dl
    from decoderlab.export import export

    path = {"missing": tmp_path / "nothing", "plain file": tmp_path / "notes.txt",
            "empty directory": tmp_path / "empty"}[kind]
    if kind == "plain file":
        path.write_text("not a model")
    elif kind == "empty directory":
        path.mkdir()
    with pytest.raises(FileNotFoundError) as front_door:
        dl.load(path)
    out = tmp_path / "out.gguf"
    with pytest.raises(FileNotFoundError) as exported:
        export(path, out)
    assert str(exported.value) == str(front_door.value)
    assert "a checkpoint is a decoderlab run or checkpoint directory" in str(exported.value)
    assert not out.exists()
