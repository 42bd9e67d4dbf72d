"""The tokenizer rebuilt from a GGUF file's tokenizer.ggml.* equals the tokenizers file it came from, for each
pre-tokenizer llama.cpp names (gpt-2, smollm, llama-bpe, qwen2) on 200 strings, and equals transformers' own
GGUF tokenizer where transformers splits as llama.cpp does, and llama.cpp's own (where llama-cpp-python is
installed); a SentencePiece vocabulary likewise; the chat template is the file's; SmolLM2's real file gives
transformers' ids on 200 strings; vocabularies it does not rebuild are refused in one line. Where a file leaves
out a special id or flag, llama.cpp's defaults apply: a text's ids as a prompt are llama.cpp's own
(``tokenize`` with its special tokens) where llama-cpp-python is installed, and the defaults table's always."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoderlab.gguf import PRE_TOKENIZERS, read_gguf
from decoderlab.gguf.reader import GGUFFile
from decoderlab.gguf.tokenizer import check_tokenizer, hf_tokenizer, special_ids

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

PRES = ["gpt-2", "smollm", "llama-bpe", "qwen2"]


@pytest.fixture(scope="module")
def strings(shared_dir):
    from support.gguf_files import sample_strings

    return sample_strings(shared_dir, 200)


@pytest.fixture(scope="module")
def trained(shared_dir):
    """Per pre-tokenizer name: a byte-level BPE of 1,000 tokens trained on Shakespeare and GSM8K text (smollm's:
    trained with GPT-2's split, so it has merges of digits that only its digit split keeps apart)."""
    from support.gguf_files import byte_level_bpe, hf_pre_tokenizer

    data = shared_dir / "data"
    texts = [(data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:150_000],
             (data / "gsm8k_train.jsonl").read_text(encoding="utf-8")[:150_000]]
    out = {pre: byte_level_bpe(1000, pre="gpt-2" if pre == "smollm" else pre, texts=texts) for pre in PRES}
    out["smollm"].pre_tokenizer = hf_pre_tokenizer("smollm")
    return out


def written(tmp_path, tok, pre: str, **options):
    from support.gguf_files import hf_model, write_gguf

    model = hf_model("llama", tok.get_vocab_size())
    return write_gguf(tmp_path / f"{pre}.gguf", "llama", model, tok, pre=pre, **options)


def ids(tok, texts):
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


@pytest.mark.parametrize("pre", PRES)
def test_rebuilt_tokenizer_equals_its_source(tmp_path, trained, strings, pre):
    path = written(tmp_path, trained[pre], pre)
    ours = hf_tokenizer(GGUFFile(path).metadata)
    assert ids(ours, strings) == ids(trained[pre], strings)
    if pre != "gpt-2":  # the split matters: GPT-2's split of the same vocabulary gives other ids
        plain = hf_tokenizer({**GGUFFile(path).metadata, "tokenizer.ggml.pre": "gpt-2"})
        assert ids(plain, strings) != ids(ours, strings)
    assert [ours.decode(i, skip_special_tokens=False) for i in ids(ours, strings)] == strings


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])  # transformers gives smollm no digit split
def test_rebuilt_tokenizer_equals_transformers_gguf_tokenizer(tmp_path, trained, strings, pre):
    path = written(tmp_path, trained[pre], pre)
    ours = hf_tokenizer(GGUFFile(path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ids(ours, strings) == [theirs(t, add_special_tokens=False)["input_ids"] for t in strings]


def test_control_tokens_special_ids_and_template(tmp_path, trained):
    from support.gguf_files import CHATML

    path = written(tmp_path, trained["gpt-2"], "gpt-2")
    contents = read_gguf(path)
    tok = contents.tokenizer
    assert tok.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 1  # whole, a special token
    assert contents.info.special_ids == {"bos": 1, "eos": 2}
    assert contents.info.chat_template == CHATML
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert theirs.chat_template == contents.info.chat_template
    assert special_ids({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.eos_token_id": 5}) == {}


@pytest.mark.parametrize("change,what", [
    ({"tokenizer.ggml.model": "llama"}, "the SentencePiece vocabulary has no scores"),
    ({"tokenizer.ggml.model": "t5"}, "a Unigram vocabulary"),
    ({"tokenizer.ggml.model": "bert"}, "WordPiece"),
    ({"tokenizer.ggml.pre": "chameleon"}, "'chameleon' is not a pre-tokenizer decoderlab rebuilds; allowed:"),
    ({"tokenizer.ggml.merges": []}, "no merges"),
    ({"tokenizer.ggml.tokens": []}, "no tokenizer"),
])
def test_tokenizers_not_rebuilt_are_refused_in_one_line(change, what):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], **change}
    with pytest.raises(ValueError) as e:
        check_tokenizer(meta, "x.gguf")
    assert what in str(e.value) and "\n" not in str(e.value) and "x.gguf" in str(e.value)


@pytest.mark.slow
def test_real_file_tokenizer_equals_transformers(smollm_path, strings):
    ours = hf_tokenizer(GGUFFile(smollm_path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
    assert ids(ours, strings) == [theirs(t, add_special_tokens=False)["input_ids"] for t in strings]
    assert theirs.chat_template == GGUFFile(smollm_path).metadata["tokenizer.chat_template"]
    from decoderlab.gguf.loader import _named_tokens, read_info
    from decoderlab.tokenizers import BPETokenizer, encode_with_special_tokens

    tok = BPETokenizer(ours, special_tokens=_named_tokens(read_info(smollm_path)))
    assert not tok.add_bos_token  # the file says false: a SmolLM2 prompt is its text's ids alone, as llama.cpp
    # a prompt as transformers reads it: its special tokens written in the text (``<|im_start|>``) are those tokens
    assert [encode_with_special_tokens(tok, t) for t in strings] == [theirs(t)["input_ids"] for t in strings]
    assert any(tok.encode(t) != theirs(t)["input_ids"] for t in strings)  # (the strings hold such a token)


@pytest.fixture(scope="module")
def spm_vocab(shared_dir):
    from support.gguf_files import sentencepiece_vocab

    data = shared_dir / "data"
    texts = [(data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000],
             (data / "gsm8k_train.jsonl").read_text(encoding="utf-8")[:100_000]]
    return sentencepiece_vocab(texts)


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory, spm_vocab):
    from support.gguf_files import hf_model, write_gguf

    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_gguf(path, "llama", hf_model("llama", len(spm_vocab["tokens"])), spm_vocab, chat_template=None)


def test_a_sentencepiece_vocabulary_equals_transformers_gguf_tokenizer(spm_file, strings):
    """Llama 2's kind of vocabulary (tokenizer.ggml.model 'llama': scores, byte tokens, no merges): ids equal
    transformers' own GGUF tokenizer on the strings that do not start with a space (byte fallback for what the
    pieces lack), and decode back. (A text starting with a space gets the prefix space from us and llama.cpp,
    "▁▁", and none from transformers' GGUF loader -- below, llama.cpp is the judge.)"""
    ours = hf_tokenizer(GGUFFile(spm_file).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    plain = [t for t in strings if "<s>" not in t and "</s>" not in t and not t[:1].isspace()]
    assert len(plain) > 150
    assert ids(ours, plain) == [theirs(t, add_special_tokens=False)["input_ids"] for t in plain]
    assert any(3 <= i < 259 for row in ids(ours, plain) for i in row)  # bytes fell back
    assert [ours.decode(i) for i in ids(ours, plain)] == [theirs.decode(i) for i in ids(ours, plain)]


@pytest.mark.parametrize("pre", PRES + ["sentencepiece"])
def test_llama_cpp_tokenizes_as_the_rebuilt_tokenizer(tmp_path, trained, spm_file, strings, pre):
    """Where llama-cpp-python is installed: llama.cpp's own tokenizer (the vocabulary alone loaded) gives the
    rebuilt tokenizer's ids on 200 strings, for each pre-tokenizer and for a SentencePiece vocabulary."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = spm_file if pre == "sentencepiece" else written(tmp_path, trained[pre], pre)
    ours = hf_tokenizer(GGUFFile(path).metadata)
    ours.encode_special_tokens = True  # a control token typed in text is text, as llama.cpp's special=False
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert ids(ours, strings) == [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in strings]


def test_a_sentencepiece_file_loads_with_a_tokenizer_that_round_trips(spm_file):
    from decoderlab.gguf import load_gguf

    _, tok, info = load_gguf(spm_file)
    text = "Hello there, café 東京! 12 + 7"
    assert tok.decode(tok.encode(text)) == text and tok.bos_id == 1 and tok.eos_id == 2 and tok.add_bos_token
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text)).decode("utf-8").strip() == text


def test_a_sentencepiece_files_tokenizer_is_kept_in_the_cache_and_read_back_equal(spm_file, strings, tmp_path,
                                                                                  monkeypatch):
    """A SentencePiece file's merges are written to the cache at the first load and read from it at the next
    (Gemma 3's took ~2 s to derive): the same tokenizer, the same ids on every string; a damaged entry is derived
    again and replaced; another file (path, size or time) gets its own entry."""
    from decoderlab.gguf.loader import _tokenizer

    monkeypatch.setenv("DECODERLAB_CACHE", str(tmp_path))
    meta = GGUFFile(spm_file).metadata
    built = _tokenizer(meta, spm_file)
    (kept,) = (tmp_path / "gguf-tokenizers").glob("*.npy")
    read = _tokenizer(meta, spm_file)
    assert ids(read, strings) == ids(built, strings) and read.to_str() == built.to_str()
    good = kept.read_bytes()
    kept.write_bytes(b"not an array")
    assert ids(_tokenizer(meta, spm_file), strings) == ids(built, strings)
    assert kept.read_bytes() == good  # replaced by the derived one
    other = tmp_path / "other.gguf"
    other.write_bytes(Path(spm_file).read_bytes())
    _tokenizer(meta, other)
    assert len(list((tmp_path / "gguf-tokenizers").glob("*.npy"))) == 2


def test_a_sentencepiece_file_reads_a_text_prompt_with_the_start_token_as_llama_cpp(spm_file):
    """tokenizer.ggml.add_bos_token: a text prompt starts with <s>, the ids of llama.cpp's ``tokenize(text,
    add_bos=True)`` (which reads the same flag) and of transformers' GGUF tokenizer ``tokenizer(text)``; the
    greedy continuation of the text is the transformers model's after those ids."""
    from hf.families import greedy_tokens
    from support.gguf_files import hf_model

    import decoderlab as dl
    from decoderlab.tokenizers import encode_with_special_tokens

    llama_cpp = pytest.importorskip("llama_cpp")
    m = dl.load(spm_file)
    llm = llama_cpp.Llama(model_path=str(spm_file), vocab_only=True, verbose=False)
    theirs = transformers.AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    for text in ("To be, or not to be", "Natalia sold clips to 48 of her friends", "café 東京"):
        want = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
        assert want[0] == m.tokenizer.bos_id == 1 and want[1:] == m.tokenizer.encode(text), text
        assert encode_with_special_tokens(m.tokenizer, text) == m.tokenize(text) == want == theirs(text)["input_ids"]
    hf = hf_model("llama", len(m.tokenizer.id_to_token))  # the weights spm_file holds (seed 0)
    assert m.generate(text, 6, temperature=0, stop_at_eos=False) == m.detokenize(greedy_tokens(hf, want, 6))


# ---------------------------------------------------------------------------------------------------------
# llama.cpp's defaults where a file states no id or flag (llama_vocab::impl::load)
# ---------------------------------------------------------------------------------------------------------

TEXTS = ("To be, or not to be", "Natalia sold clips to 48 of her friends", "café 東京")


def prompt_ids(path, text: str) -> list[int]:
    """decoderlab's ids of ``text`` as a prompt of the file at ``path`` (load_gguf, then the tokens its tokenizer
    puts around a whole text) -- checked equal to llama.cpp's own (``tokenize`` with its special tokens) where
    llama-cpp-python is installed."""
    from decoderlab.gguf import load_gguf
    from decoderlab.tokenizers import encode_with_special_tokens

    _, tok, _ = load_gguf(path)
    ours = encode_with_special_tokens(tok, text)
    try:
        import llama_cpp
    except ImportError:
        return ours
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert ours == llm.tokenize(text.encode("utf-8"), add_bos=True, special=False), text
    return ours


def spm_written(tmp_path, vocab, name: str, **keys):
    """The SentencePiece file with some ids and flags changed (``tokenizer.ggml.<key>=value``; None: left out)."""
    from support.gguf_files import hf_model, write_gguf

    extra = {f"tokenizer.ggml.{k}": v for k, v in keys.items()}
    return write_gguf(tmp_path / f"{name}.gguf", "llama", hf_model("llama", len(vocab["tokens"])), vocab,
                      chat_template=None, extra=extra)


def test_a_sentencepiece_file_without_add_bos_token_starts_a_text_with_bos(tmp_path, spm_vocab):
    from decoderlab.gguf.tokenizer import VOCAB_DEFAULTS

    path = spm_written(tmp_path, spm_vocab, "no-add-bos", add_bos_token=None)
    assert VOCAB_DEFAULTS["llama"]["add_bos"] and VOCAB_DEFAULTS["llama"]["bos"] == 1
    for text in TEXTS:
        ids = prompt_ids(path, text)
        assert ids[0] == 1 and ids[1:] == hf_tokenizer(GGUFFile(path).metadata).encode(text).ids, text


def test_a_sentencepiece_file_without_ids_has_llama_cpp_s_unk_bos_and_eos(tmp_path, spm_vocab):
    """No bos, eos or unk id in the file: <unk> <s> </s> are 0 1 2, as llama.cpp's loader assumes -- the prompt
    starts with <s>, generation stops at </s>, and with add_eos_token a text ends with it."""
    from decoderlab.gguf import load_gguf
    from decoderlab.gguf.tokenizer import VOCAB_DEFAULTS

    gone = dict(bos_token_id=None, eos_token_id=None, unknown_token_id=None)
    _, tok, info = load_gguf(spm_written(tmp_path, spm_vocab, "no-ids", **gone))
    assert info.special_ids == {k: VOCAB_DEFAULTS["llama"][k] for k in ("bos", "eos", "unk")} == \
        {"bos": 1, "eos": 2, "unk": 0}
    assert (tok.bos_id, tok.eos_id, tok.special_tokens["unk_token"]) == (1, 2, "<unk>")
    path = spm_written(tmp_path, spm_vocab, "no-ids-eos", add_eos_token=True, **gone)
    for text in TEXTS:
        ids = prompt_ids(path, text)
        assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1], text


def test_a_llama_3_bpe_file_without_add_bos_token_starts_a_text_with_bos(tmp_path, trained):
    """tokenizer.ggml.pre llama-bpe (and the other names llama.cpp gives add_bos = true: llama3, falcon3, pixtral,
    ...) without tokenizer.ggml.add_bos_token: a prompt starts with the file's bos; GPT-2's, SmolLM's and Qwen2's
    names do not."""
    from decoderlab.gguf.tokenizer import VOCAB_DEFAULTS

    named = [p for p in PRE_TOKENIZERS if VOCAB_DEFAULTS.get(f"gpt2/{p}", {}).get("add_bos")]
    assert {"llama-bpe", "llama3", "falcon3", "pixtral"} <= set(named) and "gpt-2" not in named
    for pre in [*named, "gpt-2", "smollm", "qwen2"]:  # (one vocabulary under each name: only the flag matters)
        path = written(tmp_path, trained["llama-bpe"], pre, extra={"tokenizer.ggml.add_bos_token": None})
        bos = GGUFFile(path).metadata["tokenizer.ggml.bos_token_id"]
        ids = prompt_ids(path, TEXTS[0])
        assert (ids[0] == bos) == (pre in named), pre


def test_a_byte_level_bpe_file_without_ids_has_llama_cpp_s_bos_and_eos(tmp_path, trained):
    """No bos or eos id in a byte-level BPE file: both are id 11 (llama.cpp's default, Falcon's), so a Llama 3
    file's prompt starts with token 11, and generation stops there."""
    from decoderlab.gguf import load_gguf
    from decoderlab.gguf.tokenizer import VOCAB_DEFAULTS

    gone = {"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None,
            "tokenizer.ggml.add_bos_token": None}
    path = written(tmp_path, trained["llama-bpe"], "llama-bpe", extra=gone)
    _, tok, info = load_gguf(path)
    assert info.special_ids == {"bos": VOCAB_DEFAULTS["gpt2"]["bos"], "eos": VOCAB_DEFAULTS["gpt2"]["eos"]} == \
        {"bos": 11, "eos": 11}
    assert tok.eos_id == tok.bos_id == 11 and info.add_bos and not info.add_eos
    assert prompt_ids(path, TEXTS[1])[0] == 11


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_add_eos_token_ends_a_text_with_eos(tmp_path, trained, pre):
    """tokenizer.ggml.add_eos_token true: a prompt ends with the file's eos, as llama.cpp's tokenize appends it; the
    file written again says so too."""
    path = written(tmp_path, trained[pre], pre, extra={"tokenizer.ggml.add_eos_token": True})
    eos = GGUFFile(path).metadata["tokenizer.ggml.eos_token_id"]
    for text in TEXTS:
        ids = prompt_ids(path, text)
        assert ids[-1] == eos and eos not in ids[:-1], text
    (tmp_path / "plain").mkdir()
    assert prompt_ids(written(tmp_path / "plain", trained[pre], pre), TEXTS[0])[-1] != eos  # (the writer's false)
    from decoderlab.gguf import load_gguf, save_gguf

    model, tok, _ = load_gguf(path)  # and written again, the flag kept
    save_gguf(model, tok, tmp_path / "again.gguf")
    assert GGUFFile(tmp_path / "again.gguf").metadata["tokenizer.ggml.add_eos_token"] is True


def test_a_flag_without_its_token_is_refused_in_one_line():
    """add_bos_token true where no bos id is stated and llama.cpp's default (11) is outside a 3-token vocabulary:
    refused, as llama.cpp refuses the file ("tokenizer.ggml.add_bos_token is true, but ... is not set")."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"]}
    check_tokenizer(meta, "x.gguf")
    for flag, role in (("add_bos_token", "bos"), ("add_eos_token", "eos")):
        with pytest.raises(ValueError) as e:
            check_tokenizer({**meta, f"tokenizer.ggml.{flag}": True}, "x.gguf")
        assert str(e.value) == (f"x.gguf: tokenizer.ggml.{flag} is true but the file names no {role} token "
                                f"(tokenizer.ggml.{role}_token_id absent or outside its 3 tokens), as llama.cpp "
                                f"refuses too")
    check_tokenizer({**meta, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 2}, "x.gguf")
