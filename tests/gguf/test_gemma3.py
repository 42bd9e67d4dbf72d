"""llama.cpp's gemma3 architecture both ways (decoderlab.gguf.gemma3): a tiny Gemma 3 file written the way llama.cpp's
converter names things (norms shifted by 1, the sliding window, the full layers' rope base) loads with the logits of
the transformers model it came from and of transformers' own GGUF loader (1e-5, a sequence longer than the window),
its SentencePiece tokenizer gives transformers' ids on 200 strings, and our writer's file reads back with the same
logits and ids; a model llama.cpp's gemma3 would compute otherwise is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from decoderlab.gguf import load_gguf, save_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory, shared_dir):
    """(path, the transformers model it was written from) of a tiny gemma3 file with Gemma's SentencePiece layout."""
    from support.gguf_files import gemma_sentencepiece_vocab, hf_model, sample_strings, write_gguf

    vocab = gemma_sentencepiece_vocab(sample_strings(shared_dir, 200), 700)
    model = hf_model("gemma3", len(vocab["tokens"]))
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    return write_gguf(path, "gemma3", model, vocab, chat_template=None), model


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


def test_a_gemma3_file_gives_the_logits_of_its_model_and_of_transformers_gguf_loader(gemma3_file):
    path, hf = gemma3_file
    ours, tok, info = load_gguf(path)
    cfg = ours.config
    assert info.architecture == "gemma3" and cfg.sliding_window == 4 and cfg.rope_local_theta == 10_000.0
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",) and cfg.n_kv_head == 1
    assert cfg.sandwich_norm and cfg.embed_scale and cfg.mlp == "geglu" and cfg.head_dim == 256
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))  # 16 > window 4
    assert logits(ours, ids).abs().max() > 0.1
    torch.testing.assert_close(logits(ours, ids), logits(hf, ids), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), rtol=0, atol=1e-5)
    assert (tok.bos_id, tok.eos_id, tok.add_bos_token) == (2, 1, True)


def test_the_window_and_the_norm_shift_matter(gemma3_file):
    """Read without the window, or with Gemma's stored weights taken as gains, the logits are others."""
    path, hf = gemma3_file
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    model, _, _ = load_gguf(path)
    for block in model.blocks:
        block.attention.sliding_window = None
    assert (logits(model, ids) - logits(hf, ids)).abs().max() > 1e-3
    model, _, _ = load_gguf(path)
    with torch.no_grad():
        model.blocks[0].norm_1_post.weight.sub_(1.0)
    assert (logits(model, ids) - logits(hf, ids)).abs().max() > 1e-3


def test_its_sentencepiece_tokenizer_gives_transformers_ids_on_200_strings(gemma3_file, shared_dir):
    from support.gguf_files import sample_strings

    path, _ = gemma3_file
    _, tok, _ = load_gguf(path)
    auto = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = sample_strings(shared_dir, 200, seed=3)
    bad = [t for t in texts if tok.with_special_tokens(tok.encode(t)) != auto(t)["input_ids"]]
    assert not bad, f"{len(bad)} of 200 differ, e.g. {bad[0]!r}"
    assert all(tok.decode(tok.encode(t)) == t for t in texts)


def test_our_writer_s_gemma3_file_reads_back_with_the_same_logits_and_ids(gemma3_file, tmp_path, shared_dir):
    from support.gguf_files import sample_strings

    path, hf = gemma3_file
    model, tok, _ = load_gguf(path)
    out = tmp_path / "written.gguf"
    info = save_gguf(model, tok, out, dtype="float32")
    assert info["architecture"] == "gemma3"
    back, tok2, _ = load_gguf(out)
    assert back.config == model.config
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(back, ids), logits(model, ids), rtol=0, atol=0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name).eval()
    torch.testing.assert_close(logits(theirs, ids), logits(hf, ids), rtol=0, atol=1e-5)
    texts = sample_strings(shared_dir, 200, seed=4)
    assert [tok2.encode(t) for t in texts] == [tok.encode(t) for t in texts]
    assert (tok2.bos_id, tok2.eos_id, tok2.add_bos_token) == (2, 1, True)


def test_a_model_llama_cpp_s_gemma3_computes_otherwise_is_refused_naming_the_field(gemma3_file, tmp_path):
    path, _ = gemma3_file
    model, tok, _ = load_gguf(path)
    for fields, field in ((dict(layer_types=("sliding_attention",) * 4 + ("full_attention",) * 2), "layer_types"),
                          (dict(rope_local_theta=100.0), "rope_local_theta"),
                          (dict(query_pre_attn_scalar=64.0), "query_pre_attn_scalar")):
        model.config = model.config.replace(**fields)
        with pytest.raises(ValueError, match=field) as e:
            save_gguf(model, tok, tmp_path / "no.gguf")
        assert e.value.field == field and not (tmp_path / "no.gguf").exists()
        model.config = load_gguf(path)[0].config


@pytest.mark.parametrize("key,value,words", [
    ("gemma3.final_logit_softcapping", 30.0, "asks for soft-capped logits"),
    ("gemma3.attention.sliding_window", None, "gemma3.attention.sliding_window is missing"),
    ("gemma3.attention.sliding_window_pattern", "six", "sliding_window_pattern is 'six'"),
])
def test_a_gemma3_file_we_do_not_compute_is_refused_naming_the_key(tmp_path, key, value, words):
    from support.gguf_files import gemma_sentencepiece_vocab, hf_model, write_gguf

    vocab = gemma_sentencepiece_vocab(["a b c d e f"] * 5, 300)
    path = write_gguf(tmp_path / "bad.gguf", "gemma3", hf_model("gemma3", len(vocab["tokens"])), vocab,
                      chat_template=None, extra={key: value})
    with pytest.raises(ValueError, match=words):
        load_gguf(path)


def test_a_gemma3_file_goes_out_as_a_hugging_face_directory_with_its_logits_and_its_start_token(gemma3_file, tmp_path,
                                                                                              shared_dir):
    """GGUF in, Hugging Face out: Gemma3ForCausalLM with the file's logits, and AutoTokenizer's ids are ours with
    <bos> first -- the file says add_bos_token and its tokenizer has no post-processor, so the written
    tokenizer.json gets one (transformers 5 reads no add_bos_token of a PreTrainedTokenizerFast)."""
    from support.gguf_files import sample_strings

    from decoderlab.export import to_hf

    path, hf = gemma3_file
    model, tok, _ = load_gguf(path)
    assert to_hf(model, tok, tmp_path / "out")["architecture"] == "Gemma3ForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, tok.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(logits(back, ids), logits(hf, ids), rtol=0, atol=1e-5)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    texts = sample_strings(shared_dir, 200, seed=6)
    assert [auto(t)["input_ids"] for t in texts] == [tok.with_special_tokens(tok.encode(t)) for t in texts]
    assert auto("hi")["input_ids"][0] == 2
