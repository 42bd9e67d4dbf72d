"""GGUF export (decoderlab.export): every tensor read back with gguf's own reader equals ours (f32 exactly, f16 as
float16, q8_0 within one quantization step of each block); the tokenizer inside the file is ours (tokens, types,
merges, the control ids); unsupported shapes and tokenizers are refused naming the option; and where
llama-cpp-python is installed, llama.cpp tokenizes as we do and decodes our greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab.export import ExportShapeError, check_shape, to_gguf
from decoderlab.tokenizers import BPETokenizer, CharTokenizer

gguf = pytest.importorskip("gguf")

TEXT = open(dl.embedded_corpus_path(), encoding="utf-8").read()[:20_000]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXT, 400)


@pytest.fixture(scope="module")
def char_tok():
    return CharTokenizer(TEXT[:4000] + "é€😀")  # one-, two-, three- and four-byte characters


def gpt2_model(num_tokens: int, seed: int = 0, **overrides) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(seed)
    shape = dict(n_layer=2, n_head=2, d_model=64, max_len=48, num_tokens=num_tokens, **overrides)
    return dl.DecoderOnlyTransformer(dl.preset("gpt2", **shape)).eval()


def read(path) -> tuple[dict, dict]:
    """(tensors by name as (type name, float32 array in our (rows, cols) layout), fields by name)."""
    r = gguf.GGUFReader(str(path))
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        tensors[t.name] = (t.tensor_type.name, data)
    return tensors, r.fields


def field(fields, name):
    f = fields[name]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def ours(model) -> dict[str, np.ndarray]:
    """Our tensors under their GGUF names, written out here from the model's own modules."""
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["we.weight"], "position_embd.weight": sd["pe.weight"],
           "output_norm.weight": sd["norm_f.weight"], "output_norm.bias": sd.get("norm_f.bias")}
    names = {"norm_1": "attn_norm", "attention.qkv": "attn_qkv", "attention.proj": "attn_output",
             "norm_2": "ffn_norm", "mlp.fc": "ffn_up", "mlp.proj": "ffn_down"}
    for i in range(model.config.n_layer):
        for a, b in names.items():
            w = sd[f"blocks.{i}.{a}.weight"]
            out[f"blk.{i}.{b}.weight"] = w
            out[f"blk.{i}.{b}.bias"] = sd.get(f"blocks.{i}.{a}.bias", np.zeros(w.shape[0]))
    if out["output_norm.bias"] is None:
        out["output_norm.bias"] = np.zeros_like(out["output_norm.weight"])
    if not model.config.tie_weights:
        out["output.weight"] = sd["fc_layer.weight"]
    return out


@pytest.mark.parametrize("overrides", [dict(), dict(bias=False, tie_weights=False)], ids=["tied", "untied-no-bias"])
def test_f32_tensors_read_back_equal_ours_exactly(bpe, tmp_path, overrides):
    model = gpt2_model(bpe.vocab_size, **overrides)
    summary = to_gguf(model, bpe, tmp_path / "m.gguf", dtype="f32")
    tensors, fields = read(tmp_path / "m.gguf")
    want = ours(model)
    assert set(tensors) == set(want) and summary["tensors"] == len(want)
    for name, w in want.items():
        kind, got = tensors[name]
        assert kind == "F32" and got.shape == w.shape, name
        assert np.array_equal(got.astype(np.float64), w), name
    cfg = model.config
    assert field(fields, "general.architecture") == "gpt2"
    assert [field(fields, f"gpt2.{k}") for k in ("context_length", "embedding_length", "feed_forward_length",
                                                  "block_count", "attention.head_count")] == \
        [cfg.max_len, cfg.d_model, cfg.ff_size, cfg.n_layer, cfg.n_head]
    assert field(fields, "gpt2.attention.layer_norm_epsilon") == pytest.approx(cfg.norm_eps)


def test_f16_and_q8_0_matrices_with_f32_norms_biases_and_positions(bpe, tmp_path):
    model = gpt2_model(bpe.vocab_size, seed=1)
    want = ours(model)
    to_gguf(model, bpe, tmp_path / "h.gguf", dtype="f16")
    to_gguf(model, bpe, tmp_path / "q.gguf", dtype="q8_0")
    half, _ = read(tmp_path / "h.gguf")
    q8, fields = read(tmp_path / "q.gguf")
    matrices = {n for n, w in want.items() if w.ndim == 2 and n != "position_embd.weight"}
    assert matrices == {"token_embd.weight"} | {f"blk.{i}.{b}.weight" for i in range(2)
                                                for b in ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
    for name, w in want.items():
        if name not in matrices:
            assert half[name][0] == q8[name][0] == "F32" and np.array_equal(q8[name][1], w), name
            continue
        assert half[name][0] == "F16" and np.array_equal(half[name][1], w.astype(np.float16).astype(np.float32))
        kind, got = q8[name]
        assert kind == "Q8_0", name
        blocks, back = w.reshape(-1, 32), got.reshape(-1, 32).astype(np.float64)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one quantization step of each block
        # half a step of rounding, plus the float16 rounding of the stored scale (2^-11) times |q| <= 127
        assert (np.abs(back - blocks) <= step * (0.5 + 127 * 2.0**-11) * (1 + 1e-6)).all(), name
        assert np.abs(back - blocks).max() > 0  # (it is quantized)
    assert field(fields, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
def test_block_matrices_are_llama_cpps_bytes_and_a_quantized_model_writes_its_own(dtype, bpe, tmp_path):
    """Each block type's matrices are the bytes llama.cpp's reference quantizers write (gguf.quants.quantize);
    a model loaded with --dtype of that type writes its blocks as they are, not quantized again."""
    from decoderlab.dtypes import to_inference_dtype

    model = gpt2_model(bpe.vocab_size, seed=2)
    want = ours(model)
    to_gguf(model, bpe, tmp_path / "a.gguf", dtype=dtype)
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    for t in reader.tensors:
        if t.name.endswith(".weight") and want[t.name].ndim == 2 and t.name != "position_embd.weight":
            assert t.tensor_type == qtype
            assert np.array_equal(np.asarray(t.data), gguf.quants.quantize(want[t.name], qtype)), t.name
    quantized = to_inference_dtype(gpt2_model(bpe.vocab_size, seed=2), dtype)
    to_gguf(quantized, bpe, tmp_path / "b.gguf", dtype=dtype)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_the_bpe_tokenizer_is_in_the_file_with_its_merges_and_pre_tokenizer(bpe, tmp_path):
    to_gguf(gpt2_model(bpe.vocab_size), bpe, tmp_path / "m.gguf")
    _, fields = read(tmp_path / "m.gguf")
    tokens = field(fields, "tokenizer.ggml.tokens")
    types = field(fields, "tokenizer.ggml.token_type")
    assert field(fields, "tokenizer.ggml.model") == "gpt2" and field(fields, "tokenizer.ggml.pre") == "gpt-2"
    assert tokens == [bpe.id_to_token[i] for i in range(bpe.vocab_size)]  # vocab.json's spelling
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted(bpe.special_ids)
    merges = bpe.to_dict()["model"]["merges"]
    assert field(fields, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert field(fields, "tokenizer.ggml.eos_token_id") == bpe.eos_id == 1
    assert field(fields, "tokenizer.ggml.padding_token_id") == bpe.pad_id == 0
    assert field(fields, "tokenizer.ggml.add_bos_token") is False


def test_a_char_vocabulary_is_one_token_per_character_with_merges_for_multibyte_ones(char_tok, tmp_path):
    to_gguf(gpt2_model(char_tok.vocab_size), char_tok, tmp_path / "c.gguf")
    _, fields = read(tmp_path / "c.gguf")
    tokens = field(fields, "tokenizer.ggml.tokens")
    merges = field(fields, "tokenizer.ggml.merges")
    assert tokens[:2] == ["<PAD>", "<EOS>"]
    assert tokens[char_tok.token_to_id[" "]] == "Ġ" and tokens[char_tok.token_to_id["\n"]] == "Ċ"
    assert tokens[char_tok.token_to_id["é"]] == "Ã©"  # b"\xc3\xa9" in the byte-level alphabet
    # the merges join each multi-byte character's bytes left to right, spelt in GPT-2's byte alphabet
    spelt = {b: chr(b) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b else None for b in range(256)}
    extra = iter(range(0x100, 0x200))
    spelt = {b: c if c is not None else chr(next(extra)) for b, c in spelt.items()}
    want = []
    for c in "é€😀":
        data = c.encode("utf-8")
        want += ["".join(spelt[b] for b in data[:k]) + " " + spelt[data[k]] for k in range(1, len(data))]
    assert merges == want and len(want) == 1 + 2 + 3


@pytest.mark.parametrize("overrides,option", [
    (dict(position="rope"), "--position rope"), (dict(norm="rmsnorm"), "--norm rmsnorm"),
    (dict(mlp="relu2"), "--mlp relu2"), (dict(qk_norm=True), "ModelConfig.qk_norm"),
])
def test_a_shape_llama_cpp_gpt2_cannot_carry_is_refused_naming_the_option(bpe, tmp_path, overrides, option):
    model = gpt2_model(bpe.vocab_size, **overrides)
    with pytest.raises(ExportShapeError, match="--format gguf carries GPT-2-shaped models only") as e:
        to_gguf(model, bpe, tmp_path / "x.gguf")
    assert option in str(e.value) and e.value.field == next(iter(overrides))
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="--format hf carries"):
        check_shape(model.config, "hf")


def test_the_default_recipe_is_refused_naming_every_field_at_once():
    with pytest.raises(ExportShapeError) as e:
        check_shape(dl.preset("baby-shakespeare-speedrun"), "gguf")
    assert ("this model has position='rope' (--position rope), mlp='relu2' (--mlp relu2), qk_norm=True "
            "(ModelConfig.qk_norm); train with --preset baby-shakespeare / shakespeare-char / gpt2 to export it"
            ) in str(e.value)
    with pytest.raises(ValueError, match="unknown export format 'onnx'; allowed: hf, gguf"):
        check_shape(dl.preset("gpt2"), "onnx")


def test_a_word_vocabulary_an_unknown_dtype_and_a_size_mismatch_are_refused(bpe, tmp_path):
    word = dl.WordTokenizer.from_texts(["the king spoke to the queen"])
    with pytest.raises(ValueError, match="a word vocabulary has no form llama.cpp reads"):
        to_gguf(gpt2_model(word.vocab_size), word, tmp_path / "w.gguf")
    with pytest.raises(ValueError, match="dtype must be one of f32, f16, q8_0, q4_0, q4_1, got 'q5_0'"):
        to_gguf(gpt2_model(bpe.vocab_size), bpe, tmp_path / "m.gguf", dtype="q5_0")
    with pytest.raises(ValueError, match="tokenizer vocabulary size 400 does not match the model's num_tokens 401"):
        to_gguf(gpt2_model(401), bpe, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python, optional: never needed by make test)
# ---------------------------------------------------------------------------------------------------------


def llama_greedy(path, prompt: list[int], n: int):
    """llama.cpp's greedy continuation (its own sampler, top-k 1) of ``prompt``, and the ``Llama``."""
    llama_cpp = pytest.importorskip("llama_cpp")
    # float32 keys and values (llama.cpp's default cache is float16); n_ctx = the model's max_len
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=48, n_threads=1, n_batch=48, type_k=0, type_v=0,
                          verbose=False)
    out = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(int(t))
        if len(out) == n:
            break
    return out, llm


@pytest.mark.parametrize("tok_name", ["bpe", "char_tok"])
def test_llama_cpp_tokenizes_as_we_do_and_decodes_our_greedy_tokens(request, tok_name, tmp_path):
    pytest.importorskip("llama_cpp")
    tok = request.getfixturevalue(tok_name)
    model = gpt2_model(tok.vocab_size, seed=3)
    with torch.no_grad():  # sharper logits than at initialisation: no near-ties between the two programs
        for p in model.parameters():
            p.mul_(4.0)
    to_gguf(model, tok, tmp_path / "m.gguf")
    text = "ROMEO: O, she doth é"
    prompt = tok.encode(text)
    assert len(prompt) + 20 <= model.config.max_len  # llama.cpp does not slide the window: stay inside it
    theirs, llm = llama_greedy(tmp_path / "m.gguf", prompt, 20)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == prompt
    assert theirs == dl.generate(model, prompt, 20, temperature=0, stop_at_eos=False)
    plain = [t for t in theirs if t not in tok.special_ids]
    assert llm.detokenize(plain) == b"".join(tok.token_bytes(t) for t in plain)
