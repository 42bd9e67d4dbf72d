"""The GGUF writer (decoderlab.gguf.save_gguf): every tensor read back with gguf's own reader equals ours (f32
exactly, f16 as float16, q8_0 within one quantization step of each block); the tokenizer inside the file is ours
(tokens, types, merges, the control ids); unsupported tokenizers, dtypes and weights are refused, nothing
written; our file read back by us, by transformers and -- where llama-cpp-python is installed -- by llama.cpp,
which tokenizes as we do, decodes our greedy tokens and computes our logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import decoderlab as dl
from decoderlab.gguf import load_gguf, save_gguf
from decoderlab.tokenizers import BPETokenizer, CharTokenizer

from support.gguf_files import field, read_back

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
    summary = save_gguf(model, bpe, tmp_path / "m.gguf", dtype="float32")
    tensors, fields = read_back(tmp_path / "m.gguf")
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


def test_bfloat16_matrices_are_torchs_rounding_and_read_back_by_the_loader(bpe, tmp_path):
    """--dtype bfloat16, inference's name, is written too (GGUF's BF16): each matrix as torch rounds it, the rest
    float32, and the file loads to the same logits as the model cast to bfloat16 matrices."""
    model = gpt2_model(bpe.vocab_size, seed=1)
    want = ours(model)
    save_gguf(model, bpe, tmp_path / "b.gguf", dtype="bfloat16")
    got, fields = read_back(tmp_path / "b.gguf")
    assert field(fields, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_BF16)
    for name, w in want.items():
        kind, data = got[name]
        matrix = w.ndim == 2 and name != "position_embd.weight"
        rounded = torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16).float().numpy() if matrix else w
        assert kind == ("BF16" if matrix else "F32") and np.array_equal(data, rounded), name
    back, _, info = load_gguf(tmp_path / "b.gguf")  # the default: the matrices kept in bfloat16
    assert str(info.report).startswith("weights as in the file: bf16 (")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p.ndim == 2 and "pe." not in p_name:
                p.copy_(p.to(torch.bfloat16).float())
        torch.testing.assert_close(back.double()(ids), model.double()(ids), rtol=0, atol=1e-9)


def test_f16_and_q8_0_matrices_with_f32_norms_biases_and_positions(bpe, tmp_path):
    model = gpt2_model(bpe.vocab_size, seed=1)
    want = ours(model)
    save_gguf(model, bpe, tmp_path / "h.gguf", dtype="float16")
    save_gguf(model, bpe, tmp_path / "q.gguf", dtype="q8_0")
    half, _ = read_back(tmp_path / "h.gguf")
    q8, fields = read_back(tmp_path / "q.gguf")
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
    save_gguf(model, bpe, tmp_path / "a.gguf", dtype=dtype)
    reader = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    qtype = getattr(gguf.GGMLQuantizationType, dtype.upper())
    for t in reader.tensors:
        if t.name.endswith(".weight") and want[t.name].ndim == 2 and t.name != "position_embd.weight":
            assert t.tensor_type == qtype
            assert np.array_equal(np.asarray(t.data), gguf.quants.quantize(want[t.name], qtype)), t.name
    quantized = to_inference_dtype(gpt2_model(bpe.vocab_size, seed=2), dtype)
    save_gguf(quantized, bpe, tmp_path / "b.gguf", dtype=dtype)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_the_bpe_tokenizer_is_in_the_file_with_its_merges_and_pre_tokenizer(bpe, tmp_path):
    save_gguf(gpt2_model(bpe.vocab_size), bpe, tmp_path / "m.gguf")
    _, fields = read_back(tmp_path / "m.gguf")
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
    save_gguf(gpt2_model(char_tok.vocab_size), char_tok, tmp_path / "c.gguf")
    _, fields = read_back(tmp_path / "c.gguf")
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


def test_a_word_vocabulary_an_unknown_dtype_and_a_size_mismatch_are_refused(bpe, tmp_path):
    word = dl.WordTokenizer.from_texts(["the king spoke to the queen"])
    with pytest.raises(ValueError, match="a word vocabulary has no form llama.cpp reads"):
        save_gguf(gpt2_model(word.vocab_size), word, tmp_path / "w.gguf")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, q8_0, q4_0, q4_1, got 'q5_0'"):
        save_gguf(gpt2_model(bpe.vocab_size), bpe, tmp_path / "m.gguf", dtype="q5_0")
    with pytest.raises(ValueError, match="tokenizer vocabulary size 400 does not match the model's num_tokens 401"):
        save_gguf(gpt2_model(401), bpe, tmp_path / "m.gguf")
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
    save_gguf(model, tok, tmp_path / "m.gguf")
    text = "ROMEO: O, she doth é"
    prompt = tok.encode(text)
    assert len(prompt) + 20 <= model.config.max_len  # llama.cpp does not slide the window: stay inside it
    theirs, llm = llama_greedy(tmp_path / "m.gguf", prompt, 20)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == prompt
    assert theirs == dl.generate(model, prompt, 20, temperature=0, stop_at_eos=False)
    plain = [t for t in theirs if t not in tok.special_ids]
    assert llm.detokenize(plain) == b"".join(tok.token_bytes(t) for t in plain)


# ---------------------------------------------------------------------------------------------------------
# the llama family: llama, qwen2, qwen3 -- ours -> GGUF -> ours, and read by transformers' GGUF loader
# ---------------------------------------------------------------------------------------------------------

LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_len=48, d_ff=96, norm="rmsnorm", position="rope",
             rope_layout="rotate_half", rope_theta=20000.0, mlp="swiglu", bias=False, attn_out_proj=True,
             lm_head_bias=False, tie_weights=True, attention="sdpa", norm_eps=1e-6)
SHAPES = {
    "llama": dict(LLAMA),
    "llama-interleaved-untied": dict(LLAMA, rope_layout="interleaved", tie_weights=False),
    "qwen2": dict(LLAMA, qkv_bias=True),
    "qwen2-interleaved": dict(LLAMA, qkv_bias=True, rope_layout="interleaved"),
    "qwen3": dict(LLAMA, qk_norm=True, qk_norm_gain=True, head_dim=24),
    "qwen3-no-gain": dict(LLAMA, qk_norm=True),
}


def llama_family(num_tokens: int, seed: int = 0, **shape) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(seed)
    model = dl.DecoderOnlyTransformer(dl.ModelConfig(num_tokens=num_tokens, **shape)).eval()
    with torch.no_grad():  # biases and gains away from their initial zeros and ones, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def logits_of(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_round_trip_ours_gguf_ours_gives_equal_logits(bpe, tmp_path, shape):
    model = llama_family(bpe.vocab_size, **SHAPES[shape])
    summary = save_gguf(model, bpe, tmp_path / "m.gguf")
    assert summary["architecture"] == shape.split("-")[0]
    back, tok, _ = load_gguf(tmp_path / "m.gguf")
    ids = torch.tensor([bpe.encode("ROMEO: O, she doth teach the torches to burn bright!")])
    # an interleaved model reads back as rotate-half: the same numbers rotated in another order (1 ulp apart)
    exact = SHAPES[shape].get("rope_layout") == "rotate_half"
    torch.testing.assert_close(logits_of(back, ids), logits_of(model, ids), rtol=0 if exact else 1e-6, atol=1e-5)
    assert tok.encode("ROMEO: hello") == bpe.encode("ROMEO: hello")
    assert back.config.rope_layout == "rotate_half"  # as any GGUF reads back


@pytest.mark.parametrize("shape", ["llama-interleaved-untied", "qwen2", "qwen3"])
def test_transformers_reads_our_gguf_to_the_same_logits(bpe, tmp_path, shape):
    """A third reader: transformers' own GGUF loader (which undoes llama.cpp's permutation its own way) computes
    our logits from our file -- the rows are in the layout llama.cpp expects."""
    transformers = pytest.importorskip("transformers")
    shape_ = SHAPES[shape] if shape != "qwen3" else dict(SHAPES[shape], head_dim=128)  # transformers' qwen3 default
    model = llama_family(bpe.vocab_size, **shape_)
    save_gguf(model, bpe, tmp_path / "m.gguf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").eval()
    ids = torch.tensor([bpe.encode("ROMEO: O, she doth teach the torches")])
    torch.testing.assert_close(logits_of(theirs, ids), logits_of(model, ids), rtol=0, atol=1e-5)


def test_lora_adapters_are_merged_before_writing(bpe, tmp_path):
    from decoderlab.lora import apply_lora, merge_lora

    base = llama_family(bpe.vocab_size, **SHAPES["llama"])
    ids = torch.tensor([bpe.encode("ROMEO: hello there")])
    before = logits_of(base, ids)
    adapted = apply_lora(base, rank=4, init=False)
    save_gguf(adapted, bpe, tmp_path / "m.gguf")
    back, _, _ = load_gguf(tmp_path / "m.gguf")
    torch.testing.assert_close(logits_of(back, ids), logits_of(merge_lora(adapted), ids), rtol=0, atol=1e-5)
    assert (logits_of(back, ids) - before).abs().max() > 1e-3  # not the base weights


def test_a_weight_outside_float16_is_refused_naming_the_tensor_and_nothing_is_written(bpe, tmp_path):
    model = llama_family(bpe.vocab_size, **SHAPES["qwen2"])
    with torch.no_grad():
        model.blocks[1].mlp.gate.weight[3, 5] = 1e5
    with pytest.raises(ValueError) as e:
        save_gguf(model, bpe, tmp_path / "m.gguf", dtype="float16")
    assert str(e.value) == ("tensor blocks.1.mlp.gate.weight holds 100000, outside float16's range (+-65504): --dtype "
                            "float16 cannot hold it; write it with --dtype float32")
    with torch.no_grad():
        model.blocks[1].mlp.gate.weight[3, 5] = 1e7  # a q8_0 scale of 1e7 / 127 overflows float16 too
    with pytest.raises(ValueError, match="blocks.1.mlp.gate.weight holds 1e\\+07"):
        save_gguf(model, bpe, tmp_path / "m.gguf", dtype="q8_0")
    assert not list(tmp_path.iterdir())
    save_gguf(model, bpe, tmp_path / "m.gguf", dtype="float32")  # float32 holds it


def test_an_existing_file_is_kept_without_force(bpe, tmp_path):
    model = gpt2_model(bpe.vocab_size)
    save_gguf(model, bpe, tmp_path / "m.gguf")
    before = (tmp_path / "m.gguf").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to replace .*m.gguf: it exists"):
        save_gguf(gpt2_model(bpe.vocab_size, seed=5), bpe, tmp_path / "m.gguf")
    assert (tmp_path / "m.gguf").read_bytes() == before
    save_gguf(gpt2_model(bpe.vocab_size, seed=5), bpe, tmp_path / "m.gguf", force=True)
    assert (tmp_path / "m.gguf").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # (the Modelfile is export's)


def test_a_gguf_model_kept_in_its_blocks_writes_the_same_blocks_back(tmp_path):
    """llama.cpp's Q4_1 file loaded with --dtype q4_1 (blocks kept, llama's rows unpermuted as rows of blocks) and
    written as q4_1: every tensor's bytes are the file's own -- the permutation went there and back exactly."""
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    tok = byte_level_bpe(300)
    src = write_gguf(tmp_path / "src.gguf", "llama", hf_model("llama", tok.get_vocab_size()), tok, qtype="Q4_1",
                     chat_template=None)
    model, mtok, _ = load_gguf(src, dtype="q4_1")
    save_gguf(model, mtok, tmp_path / "out.gguf", dtype="q4_1")
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "out.gguf"))
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors)
    for t in a.tensors:
        assert theirs[t.name].tensor_type == t.tensor_type, t.name
        assert np.array_equal(np.asarray(theirs[t.name].data), np.asarray(t.data)), t.name


@pytest.mark.parametrize("shape", ["llama", "qwen2", "qwen3-no-gain"])
def test_llama_cpp_computes_our_logits_from_our_llama_family_file(bpe, tmp_path, shape):
    """Where llama-cpp-python is installed: llama.cpp's own forward pass over our F32 file (a float32 KV cache)
    gives our logits at every position -- the architecture, the rotary layout and the tensors are what it reads."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_family(bpe.vocab_size, **SHAPES[shape])
    save_gguf(model, bpe, tmp_path / "m.gguf")
    ids = bpe.encode("ROMEO: O, she doth teach the torches to burn bright!")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=48, n_threads=1, logits_all=True, type_k=0,
                          type_v=0, verbose=False)
    llm.eval(ids)
    theirs = torch.tensor(np.asarray(llm.scores[: len(ids)]))
    torch.testing.assert_close(theirs, logits_of(model, torch.tensor([ids]))[0], rtol=0, atol=1e-3)
