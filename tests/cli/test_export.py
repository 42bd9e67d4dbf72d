"""``decoderlab export``: a run directory as one GGUF file or a Hugging Face directory; a shape the format cannot
carry is one error line naming the option, before anything is read or written; --help says what each format
carries."""

from __future__ import annotations

import json

import pytest
import torch

import decoderlab as dl
from decoderlab.cli import main as cli_main
from decoderlab.tokenizers import BPETokenizer

gguf = pytest.importorskip("gguf")


def run_dir(tmp_path, name: str, tok, **shape):
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", n_layer=1, n_head=2, d_model=32, max_len=24,
                                                num_tokens=tok.vocab_size, **shape))
    return dl.save_checkpoint(tmp_path / name, model, tok), model


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(open(dl.embedded_corpus_path(), encoding="utf-8").read()[:10_000], 300)


def test_export_gguf_writes_one_file_llama_cpp_reads_and_says_what_it_wrote(bpe, tmp_path, capsys):
    run, model = run_dir(tmp_path, "run", bpe)
    assert cli_main(["export", "--format", "gguf", "--dtype", "q8_0", "--checkpoint", str(run),
                     "--out", str(tmp_path / "m.gguf")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'm.gguf'}: gguf q8_0 (gpt2), {model.num_parameters():,} parameters")
    assert "tokenizer: bpe" in out and f"ollama: {tmp_path / 'm.Modelfile'}" in out
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert r.fields["general.name"].contents() == "run"
    assert {t.name: t.tensor_type.name for t in r.tensors}["blk.0.attn_qkv.weight"] == "Q8_0"


def test_export_hf_writes_a_gpt2_directory_with_n_ctx_that_loads_back(bpe, tmp_path, capsys):
    run, model = run_dir(tmp_path, "run", bpe)
    assert cli_main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "hf (GPT2LMHeadModel)" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["n_ctx"] == config["n_positions"] == 24  # what llama.cpp's converter reads
    back, tok = dl.hf.load_hf_directory(tmp_path / "hf")
    ids = torch.tensor([bpe.encode("ROMEO: hello")])
    with torch.no_grad():
        assert torch.allclose(back(ids), model.eval()(ids), atol=1e-5)
    assert tok.encode("ROMEO: hello") == bpe.encode("ROMEO: hello")


def test_export_hf_writes_the_default_recipe_s_model_as_apertus_with_its_tokenizer(tmp_path, capsys):
    tok = dl.CharTokenizer.from_text(open(dl.embedded_corpus_path(), encoding="utf-8").read()[:5_000])
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare-speedrun", n_layer=1, num_tokens=tok.vocab_size))
    with torch.no_grad():  # its output projections start at zero: give them something to carry
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    run = dl.save_checkpoint(tmp_path / "speedrun", model, tok)
    assert cli_main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert "hf (ApertusForCausalLM)" in out and "tokenizer: char" in out
    back = dl.load(tmp_path / "hf")
    ids = torch.tensor([tok.encode("ROMEO: hello")])
    with torch.no_grad():
        assert (back.model(ids) - model.eval()(ids)).abs().max().item() < 1e-5
    assert back.tokenizer.kind == "char" and back.tokenizer.encode("ROMEO: hello") == tok.encode("ROMEO: hello")


def test_a_rope_run_is_refused_by_gguf_in_one_line_naming_the_option_and_nothing_is_written(bpe, tmp_path, capsys):
    run, _ = run_dir(tmp_path, "rope-run", bpe, position="rope")
    (run / "model.safetensors").write_bytes(b"not read")  # the shape is refused from config.json alone
    assert cli_main(["export", "--format", "gguf", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlab: error: --format gguf writes the models a llama.cpp "
                                                    "architecture computes exactly")
    assert ("this model has position='rope' (--position rope); train with --preset baby-shakespeare / "
            "shakespeare-char / gpt2 (or --position learned) to export it") in err
    assert not (tmp_path / "out").exists()


def test_a_model_no_class_computes_is_refused_by_hf_in_one_line_and_nothing_is_written(bpe, tmp_path, capsys):
    run, _ = run_dir(tmp_path, "sinusoidal-run", bpe, position="sinusoidal")
    (run / "model.safetensors").write_bytes(b"not read")  # the shape is refused from config.json alone
    assert cli_main(["export", "--format", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("decoderlab: error: --format hf: no Hugging Face class computes "
                                                    "this model: position='sinusoidal'")
    assert "the nearest is GPT2LMHeadModel, which needs position='learned'" in err
    assert not (tmp_path / "out").exists()


def test_bad_dtype_for_hf_a_word_vocabulary_and_a_missing_run_are_one_line_each(tmp_path, capsys):
    word = dl.WordTokenizer.from_texts(["the king spoke to the queen"])
    run, _ = run_dir(tmp_path, "word-run", word)
    cases = [(["--format", "hf", "--dtype", "f16", "--checkpoint", str(run)],
              "--dtype 'f16' is not one --format hf writes; "
              "allowed: f32"),
             (["--checkpoint", str(run)], "a word vocabulary has no form llama.cpp reads"),
             (["--checkpoint", str(tmp_path / "nowhere")], "nowhere")]
    for args, message in cases:
        assert cli_main(["export", *args, "--out", str(tmp_path / "out.gguf")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("decoderlab: error:") and message in err, err
    assert not (tmp_path / "out.gguf").exists()


def test_help_says_what_each_format_carries(decoderlab_cli):
    r = decoderlab_cli("export", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for words in ("hf a Hugging Face directory of the transformers class whose forward equals the model's",
                  "Apertus (rope, QK-norm, ReLU²: the default recipe's)", "gguf one GGUF file for llama.cpp and ollama",
                  "gpt2 (learned positions, LayerNorm, GELU), llama (rope, RMSNorm, SwiGLU, grouped-query attention)",
                  "an ollama Modelfile beside it", "kept unless --force", "LoRA adapters merged first",
                  "a word vocabulary is refused", "f32, f16, q8_0, q4_0 or q4_1"):
        assert words in text, words


def test_export_keeps_an_existing_file_without_force(bpe, tmp_path, capsys):
    run, _ = run_dir(tmp_path, "run", bpe)
    out = tmp_path / "m.gguf"
    assert cli_main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli_main(["export", "--checkpoint", str(run), "--out", str(out), "--dtype", "f16"]) == 2
    err = capsys.readouterr().err
    assert err == f"decoderlab: error: refusing to replace {out}: it exists (--force, or force=True, replaces it)\n"
    assert gguf.GGUFReader(str(out)).tensors[0].tensor_type.name == "F32"
    assert cli_main(["export", "--checkpoint", str(run), "--out", str(out), "--dtype", "f16", "--force"]) == 0
    assert "gguf f16 (gpt2)" in capsys.readouterr().out


def test_export_reads_a_gguf_file_and_writes_it_again(tmp_path, capsys):
    """llama.cpp's file in, another type out (here f16 from Q8_0): the architecture, tokenizer and template kept."""
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    tok = byte_level_bpe(300)
    src = write_gguf(tmp_path / "src.gguf", "qwen2", hf_model("qwen2", tok.get_vocab_size()), tok, qtype="Q8_0")
    assert cli_main(["export", "--checkpoint", str(src), "--out", str(tmp_path / "out.gguf"), "--dtype", "f16"]) == 0
    out = capsys.readouterr().out
    assert "gguf f16 (qwen2)" in out and "tokenizer: bpe" in out
    r = gguf.GGUFReader(str(tmp_path / "out.gguf"))
    assert r.fields["tokenizer.chat_template"].contents() == gguf.GGUFReader(str(src)).fields[
        "tokenizer.chat_template"].contents()
