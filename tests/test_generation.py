"""The inference engine (issue 5): KV cache == the lesson's loop, sampling, stops, batches, text streaming, CLI.

Exactness is tested on float64 models, so that equal math gives equal argmax/samples with no float32 ties.
"""

import io
import random
import sys
from pathlib import Path

import pytest
import torch
from conftest import type_lines

import decoderlab as dl
from decoderlab.checkpoint import save_checkpoint
from decoderlab.cli import main as cli_main
from decoderlab.cli import CHAT_HELP, chat_command
from decoderlab.generation import (ChatSession, KVCache, Sampler, StopMatcher, TextStreamer, generate,
                                   generate_batch, stream, stream_text)
from decoderlab.generation.stops import Stops
from decoderlab.lesson import greedy_response
from decoderlab.tokenizers import BPETokenizer, CharTokenizer



@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread avoids waiting on a second one when the machine is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Every preset family, shrunk (same norm/position/mlp/bias/tying choices), plus rope/rmsnorm and no positions.
FAMILIES = {
    "statquest": dict(),
    "baby-shakespeare": dict(d_model=16, n_layer=2, n_head=4, max_len=12),
    "shakespeare-char": dict(d_model=24, n_layer=2, n_head=6, max_len=10),
    "gpt2": dict(num_tokens=97, d_model=16, n_layer=2, n_head=2, max_len=12),
    "rope-rmsnorm": dict(d_model=16, n_layer=2, n_head=2, max_len=9, position="rope", norm="rmsnorm"),
    "no-positions": dict(d_model=16, n_layer=1, n_head=2, max_len=8, position="none"),
}


def make_model(family: str, kernel: str, seed: int = 0) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(seed)
    base = "baby-shakespeare" if family in ("rope-rmsnorm", "no-positions") else family
    m = dl.DecoderOnlyTransformer(dl.preset(base, **FAMILIES[family], attention=kernel)).double()
    if m.config.init == "gpt2":  # random weights far from uniform logits, so greedy paths vary
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(20.0)
    return m.eval()


def lesson_loop(model, prompt, n, keep):
    """The lesson's greedy loop, written out: the whole window through the model for every new token,
    the window restarting on its last ``keep`` tokens when it passes max_len (decoderlab's rule)."""
    max_len = model.config.max_len
    ids = list(prompt)
    start = max(0, len(ids) - max_len)
    out = []
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > max_len:
                start = len(ids) - keep
            logits = model(torch.tensor(ids[start:]))
            t = int(torch.argmax(logits[-1]))
            ids.append(t)
            out.append(t)
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_cache_equals_the_lesson_loop(family, kernel):
    model = make_model(family, kernel)
    cfg = model.config
    rng = random.Random(f"{family}{kernel}")
    for trial in range(3):
        t = rng.randint(1, cfg.max_len)
        prompt = [rng.randrange(cfg.num_tokens) for _ in range(t)]
        n = rng.randint(1, 2 * cfg.max_len + 3)  # most runs pass max_len
        keep = [None, cfg.max_len, 1][trial]
        k = dl.generation.default_keep(cfg.max_len) if keep is None else keep
        want = lesson_loop(model, prompt, n, k)
        assert generate(model, prompt, n, temperature=0, keep=keep) == want
        assert generate(model, prompt, n, temperature=0, keep=keep, use_cache=False) == want
    # a prompt longer than max_len continues on its last max_len tokens
    long_prompt = [rng.randrange(cfg.num_tokens) for _ in range(cfg.max_len + 3)]
    assert generate(model, long_prompt, 5, temperature=0) == lesson_loop(model, long_prompt[3:], 5,
                                                                          dl.generation.default_keep(cfg.max_len))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_step_equals_the_model_forward(family):
    """The engine's one-token step (``model.decode``) gives the model's own logits (float64), unpadded and
    left-padded, also while the glass box records."""
    model = make_model(family, "explicit", seed=4)
    cfg = model.config
    step = model.decode
    torch.manual_seed(0)
    ids = torch.randint(cfg.num_tokens, (3, cfg.max_len))
    pads = torch.tensor([[0], [2], [cfg.max_len - 2]])
    pad_mask = torch.arange(cfg.max_len)[None] < pads  # (3, max_len), True = padded
    positions = (torch.arange(cfg.max_len)[None] - pads).clamp_min(0)
    with torch.no_grad():
        for padded in (False, True):
            want = model(ids, padding_mask=pad_mask if padded else None, positions=positions if padded else None)
            cache = KVCache.for_model(model)
            t0 = 2
            model(ids[:, :t0], padding_mask=pad_mask[:, :t0] if padded else None,
                  positions=positions[:, :t0] if padded else None, cache=cache)
            for t in range(t0, cfg.max_len):
                got = step(ids[:, t:t + 1], positions[:, t:t + 1] if padded else t,
                           pad_mask[:, :t + 1] if padded else None, cache)
                rows = [0, 1] if padded and t < cfg.max_len - 2 else [0, 1, 2]  # row 2 is all padding early
                assert torch.allclose(got[rows], want[rows, t], atol=1e-10, rtol=1e-12), (padded, t)
    model.blocks[0].attention.record = {}  # the glass box is recording: the same blocks, the same numbers
    cache = KVCache.for_model(model)
    with torch.no_grad():
        want = model(ids[:, :3])[:, 2]
        model(ids[:, :2], cache=cache)
        got = step(ids[:, 2:3], 2, None, cache)
    assert torch.allclose(got, want, atol=1e-10, rtol=1e-12)
    assert model.blocks[0].attention.record["percents"].shape == (3, cfg.n_head, 1, 3)


@pytest.mark.parametrize("kernel", ["sdpa", "explicit"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampling_with_the_same_seed_is_the_same_with_and_without_cache(family, kernel):
    model = make_model(family, kernel, seed=1)
    cfg = model.config
    prompt = [1, 2, 3][: cfg.max_len]
    n = 2 * cfg.max_len + 5
    for opts in (dict(), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.9)):
        a = generate(model, prompt, n, seed=11, **opts)
        assert a == generate(model, prompt, n, seed=11, use_cache=False, **opts)
        assert len(set(a)) > 1
    assert a == generate(model, prompt, n, seed=11, **opts)  # reproducible


def test_trained_statquest_cache_matches_greedy_response(statquest_checkpoint):
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    for prompt in ("what is statquest <EOS>", "statquest is what <EOS>"):
        ids = tok.encode(prompt)
        want = greedy_response(model, ids, tok.eos_id)
        got = generate(model, ids, model.config.max_len - len(ids), temperature=0)
        assert tok.decode(got) == tok.decode(want) == "awesome <EOS>"
        assert generate(model, ids, 9, temperature=0, stop=tok.eos_id) == want[:-1]


def test_generation_leaves_training_mode_and_global_rng_alone():
    model = make_model("shakespeare-char", "sdpa")  # dropout 0.2: must be off while generating
    model.train()
    state = torch.get_rng_state()
    a = generate(model, [1, 2], 15, seed=3)
    assert torch.equal(state, torch.get_rng_state())
    assert model.training
    assert a == generate(model, [1, 2], 15, seed=3, use_cache=False)
    assert generate(model, [1, 2], 0) == []
    # the streaming twin yields the same tokens one at a time, and grad mode is not leaked to the caller
    it = stream(model, [1, 2], 15, seed=3)
    first = next(it)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert [first, *it] == a


# ---- the sampler ----------------------------------------------------------------------------------------------


def test_top_k_and_top_p_keep_the_right_tokens():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    logits = probs.log()

    def kept(**kw):
        return torch.isfinite(Sampler(**kw).filter(logits))[0].nonzero().flatten().tolist()

    assert kept(top_p=0.5) == [1]
    assert kept(top_p=0.79) == [1, 3]
    assert kept(top_p=0.81) == [1, 2, 3]
    assert kept(top_p=1e-9) == [1]  # always at least one token
    assert kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_k=100) == [0, 1, 2, 3]  # clamped to the vocabulary
    # the draw follows the distribution (inverse CDF on one uniform per row)
    g = torch.Generator().manual_seed(0)
    n = 20000
    draws = Sampler(temperature=1.0)(logits.expand(n, 4), [g] * n)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, probs[0], atol=0.015)
    draws = Sampler(temperature=1.0, top_p=0.79)(logits.expand(n, 4), [g] * n)
    freq = torch.bincount(draws, minlength=4).double() / n
    assert torch.allclose(freq, torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64), atol=0.015)
    assert Sampler(temperature=0)(logits, []).tolist() == [1]


def test_sampling_options_on_a_model():
    model = make_model("baby-shakespeare", "sdpa", seed=2)
    greedy = generate(model, [5], 20, temperature=0)
    assert generate(model, [5], 20, top_k=1, seed=4) == greedy
    assert generate(model, [5], 20, top_p=1e-9, seed=4) == greedy
    assert generate(model, [5], 20, top_k=1000, seed=4) == generate(model, [5], 20, seed=4)
    assert generate(model, [5], 20, top_p=1.0, seed=4) == generate(model, [5], 20, seed=4)
    assert generate(model, [5], 20, seed=4) != generate(model, [5], 20, seed=5)


# ---- stop sequences -----------------------------------------------------------------------------------------


def test_stop_matcher_holds_back_prefixes():
    m = StopMatcher([(7, 8, 9), (3,)])
    assert m.push(1) == ([1], None)
    assert m.push(7) == ([], None)
    assert m.push(8) == ([], None)
    assert m.push(7) == ([7, 8], None)  # 7 8 7: "7" may still start 7 8 9
    assert m.push(8) == ([], None)
    assert m.push(9) == ([], (7, 8, 9))
    m = StopMatcher([(7, 8, 9)])
    m.push(7)
    assert m.flush() == [7]


def test_stop_tokens_and_strings():
    text = "abcabcabd ab cd"
    tok = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=16)).double()
    # no control tokens in this stream (the model would sample them: it is random)
    kw = dict(seed=9, tokenizer=tok, suppress_tokens=(tok.pad_id, tok.eos_id))
    full = generate(model, tok.encode("ab"), 40, **kw)
    assert len(full) == 40 and min(full) > 1
    # a single stop id: everything before its first occurrence
    t = full[len(full) // 2]
    got = generate(model, tok.encode("ab"), 40, stop=[t], **kw)
    assert got == full[: full.index(t)]
    # a two-token stop sequence (as ids, or as text through the tokenizer)
    j = next(i for i in range(3, len(full) - 1) if min(full[i:i + 2]) > 1)  # no <PAD>/<EOS> in the pair
    pair = tuple(full[j:j + 2])
    first = next(i for i in range(len(full) - 1) if tuple(full[i:i + 2]) == pair)
    assert generate(model, tok.encode("ab"), 40, stop=pair, **kw) == full[:first]
    s = tok.decode(list(pair))
    assert list(stream(model, "ab", 40, stop=s, **kw)) == full[:first]
    assert generate(model, "ab", 40, stop=[s], **kw) == full[:first]
    # the streaming generator returns the stop sequence it matched
    gen = stream(model, "ab", 40, stop=s, **kw)
    with pytest.raises(StopIteration) as end:
        while True:
            next(gen)
    assert end.value.value == pair


# ---- batched generation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,kernel", [("baby-shakespeare", "sdpa"), ("rope-rmsnorm", "explicit"),
                                           ("statquest", "explicit"), ("gpt2", "sdpa")])
def test_batch_equals_each_prompt_alone(family, kernel):
    model = make_model(family, kernel, seed=3)
    cfg = model.config
    rng = random.Random(family)
    lengths = [1, cfg.max_len, max(1, cfg.max_len // 2), 2, cfg.max_len + 2]
    prompts = [[rng.randrange(cfg.num_tokens) for _ in range(t)] for t in lengths]
    n = 2 * cfg.max_len + 1
    for opts in (dict(temperature=0), dict(seed=21, temperature=0.9, top_k=4)):
        batch = generate_batch(model, prompts, n, **opts)
        assert batch == [generate(model, p, n, **opts) for p in prompts]
    assert batch == generate_batch(model, prompts, n, use_cache=False, **opts)
    # stops end rows at different times; per-row seeds
    alone = [generate(model, p, n, seed=s) for p, s in zip(prompts, range(5))]
    stop = alone[0][3]
    batch = generate_batch(model, prompts, n, seed=list(range(5)), stop=stop)
    assert batch == [generate(model, p, n, seed=s, stop=stop) for p, s in zip(prompts, range(5))]
    assert batch[0] == alone[0][: alone[0].index(stop)]


# ---- text streaming -----------------------------------------------------------------------------------------


class ByteTokenizer:
    """A stand-in byte-level tokenizer: one token per byte (ids 0..255), <EOS> = 256."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def pieces_of(tok, ids):
    s = TextStreamer(tok)
    out = [s.put(i) for i in ids]
    out.append(s.end())
    return [p for p in out if p]


TEXT = "héllo wörld, naïve café -- 日本語のテキスト, emoji 😀🎉 and ∑ maths. "


def test_text_streamer_never_splits_a_character_byte_level():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    pieces = pieces_of(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces and "日" in pieces  # four and three bytes held until complete
    # a character that never completes is written as decode writes it
    cut = tok.encode("ab日")[:-1]
    assert "".join(pieces_of(tok, cut)) == tok.decode(cut) == "ab\ufffd"


def test_text_streamer_with_bpe_tokens_that_split_characters():
    tok = BPETokenizer.train([TEXT * 30], 320)
    ids = tok.encode(TEXT * 2)
    assert tok.decode(ids) == TEXT * 2
    splits = [i for i in ids if tok.decode([i]).endswith("\ufffd") or tok.decode([i]).startswith("\ufffd")]
    assert splits, "the test needs BPE tokens that end or start inside a character"
    pieces = pieces_of(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # forced sequences: single bytes of a 4-byte character, then continuing text
    emoji = [i for i in range(tok.vocab_size) if tok.token_bytes(i) in (b"\xf0", b"\x9f", b"\x98", b"\x80")]
    forced = tok.encode("a") + sorted(emoji, key=lambda i: b"\xf0\x9f\x98\x80".index(tok.token_bytes(i))) \
        + tok.encode("日本")
    pieces = pieces_of(tok, forced)
    assert "".join(pieces) == tok.decode(forced) == "a😀日本"
    assert "😀" in pieces


def test_stream_text_equals_decode_of_generate():
    tok = BPETokenizer.train([TEXT * 30], 320)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=16))
    ids = generate(model, "日本", 60, seed=2, tokenizer=tok)
    pieces = list(stream_text(model, tok, "日本", 60, seed=2))
    assert "".join(pieces) == tok.decode(ids)
    words = dl.lesson_tokenizer()
    m = make_model("statquest", "explicit")
    ids = generate(m, [0, 1], 8, seed=1)
    assert "".join(stream_text(m, words, [0, 1], 8, seed=1)) == words.decode(ids)  # separators kept


# ---- bad input ----------------------------------------------------------------------------------------------


def test_bad_inputs():
    model = make_model("baby-shakespeare", "sdpa")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        generate(model, [1], -1)
    for t in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            generate(model, [1], 3, temperature=t)
    for p in (0, 0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
            generate(model, [1], 3, top_p=p)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0, got -1"):  # 0: no top-k filter
        generate(model, [1], 3, top_k=-1)
    with pytest.raises(ValueError, match=r"token id 65 is out of range; allowed ids are 0 \.\. 64"):
        generate(model, [1, 65], 3)
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        generate_batch(model, [[1], [-1]], 3)
    with pytest.raises(ValueError, match="empty and the model has no start token"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="keep must be in 1 .. max_len=12"):
        generate(model, [1], 3, keep=13)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate_batch(model, [], 3)
    with pytest.raises(ValueError, match="one int per prompt"):
        generate_batch(model, [[1], [2]], 3, seed=[1, 2, 3])


def test_empty_prompt_starts_from_eos():
    tok = CharTokenizer.from_text("abc def")
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=8,
                                                n_layer=1, n_head=2, max_len=8)).double()
    plain = dict(suppress_tokens=(), stop_at_eos=False)  # the tokenizer only for its start token
    assert generate(model, [], 6, seed=1, tokenizer=tok, **plain) == generate(model, [tok.eos_id], 6, seed=1)


def test_stop_strings_the_tokenizer_cannot_encode():
    model = make_model("statquest", "explicit")
    words = dl.lesson_tokenizer()
    with pytest.raises(ValueError, match="stop string 'hello' cannot be encoded by the tokenizer"):
        generate(model, [0], 3, stop="hello", tokenizer=words)
    chars = CharTokenizer.from_text("abc")
    m2 = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=chars.vocab_size, d_model=8,
                                             n_layer=1, n_head=2, max_len=8))
    with pytest.raises(ValueError, match="stop string 'xyz' cannot be encoded"):
        generate(m2, [2], 3, stop=["a", "xyz"], tokenizer=chars)
    with pytest.raises(TypeError, match="needs the tokenizer"):
        generate(model, [0], 3, stop="awesome")
    with pytest.raises(ValueError, match="must not be empty"):
        generate(model, [0], 3, stop="", tokenizer=words)
    with pytest.raises(ValueError, match="stop token id 9 is out of range"):
        generate(model, [0], 3, stop=9)
    assert generate(model, [0], 3, temperature=0, stop="<EOS>", tokenizer=words) == \
        generate(model, [0], 3, temperature=0, stop=words.eos_id)


# ---- CLI ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory):
    tok = CharTokenizer.from_text("to be or not to be, that is the question\n")
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16,
                                                n_layer=1, n_head=2, max_len=24))
    out = tmp_path_factory.mktemp("lm") / "ckpt"
    save_checkpoint(out, model, tok, meta={"task": "lm"})
    return out


def test_cli_generate_streams_an_lm_checkpoint(lm_checkpoint, capsys, monkeypatch):
    model, tok = dl.load_checkpoint(lm_checkpoint)
    args = ["--max-new-tokens", "30", "--temperature", "0.8", "--top-k", "8", "--top-p", "0.95", "--seed", "13"]
    # with its tokenizer, as the CLI: <PAD> never sampled, <EOS> ends the text (this seed runs all 30 tokens)
    ids = generate(model, tok.encode("to be"), 30, temperature=0.8, top_k=8, top_p=0.95, seed=13, tokenizer=tok)
    assert len(ids) == 30
    want = tok.decode(ids)
    writes = []
    real_write = sys.stdout.write

    def recording_write(s):
        writes.append(s)
        return real_write(s)

    monkeypatch.setattr(sys.stdout, "write", recording_write)
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "to be"]) == 0
    monkeypatch.undo()
    assert capsys.readouterr().out == want + "\n"
    assert len(writes) > 5  # piece by piece, not all at the end
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "--no-stream", "to be"]) == 0
    assert capsys.readouterr().out == want + "\n"
    j = next(i for i in range(3, len(ids) - 1) if min(ids[i:i + 2]) > 1)  # two characters, no specials
    first = next(i for i in range(len(ids) - 1) if ids[i:i + 2] == ids[j:j + 2])
    stop = tok.decode(ids[j:j + 2])
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), *args, "--stop", stop, "to be"]) == 0
    assert capsys.readouterr().out == tok.decode(ids[:first]) + "\n"
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--top-p", "2", "to be"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_cli_chat_with_the_lesson_model(statquest_checkpoint, capsys, monkeypatch):
    type_lines(monkeypatch, ["what is statquest", "/temperature 0.7", "/temperature -1", "/top_k 20", "/help",
                             "/reset", "/temperature 0", "statquest is what", "what is hello", "/nope"])
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "awesome"
    assert out[1] == "(temperature = 0.7)"
    assert out[2].startswith("error: /temperature '-1'")
    assert out[3] == "(top_k = 20)"
    assert "/reset" in "\n".join(out) and "(conversation reset)" in out
    i = out.index("(temperature = 0)")
    assert out[i + 1] == "awesome"
    assert out[i + 2].startswith("error: unknown word 'hello'")
    assert out[-1].startswith("unknown command /nope")


def test_chat_session_continues_the_conversation(statquest_checkpoint):
    """A language model's session continues its token history (the lesson's word tokenizer reads a typed <EOS>
    as the token); the lesson's own chat renders its template (TemplateChatSession, tests/chat/)."""
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    chat = ChatSession(model, tok, temperature=0, max_new_tokens=model.config.max_len)
    assert "".join(chat.reply("what is statquest <EOS>")) == "awesome"
    assert tok.decode(chat.history) == "what is statquest <EOS> awesome <EOS>"
    # the next turn continues the history (the model sees its last max_len tokens)
    prompt = chat.history + tok.encode("statquest <EOS>")
    want = generate(model, prompt, model.config.max_len, temperature=0, stop=tok.eos_id)
    assert "".join(chat.reply("statquest <EOS>")) == tok.decode(want)
    chat_command(chat, "/reset")
    assert chat.history == []


def test_chat_reads_stdin_until_end_of_file(statquest_checkpoint, capsys, monkeypatch):
    """The real input() on a non-terminal stdin: two turns, then end of input (Ctrl-D) exits with 0."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("what is statquest\n/reset\nstatquest is what\n"))
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 0
    assert capsys.readouterr().out.splitlines() == ["awesome", "(conversation reset)", "awesome"]


# ---------------------------------------------------------------------------------------------------------
# arguments as typed, chat like other chats (issue 14)
# ---------------------------------------------------------------------------------------------------------


def test_unescape_understands_the_usual_backslash_escapes():
    from decoderlab.cli import unescape

    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\c\x41\u00e9\r\0") == "a\tb\\cA\u00e9\r\0"
    assert unescape("no escapes: \u00e9") == "no escapes: \u00e9"
    with pytest.raises(ValueError) as e:
        unescape(r"end\q")
    assert str(e.value) == (r"--stop 'end\q' has an unknown escape \q; known escapes: \n \t \r \\ \0 \xHH \uHHHH "
                            r"(write \\ for a backslash)")
    with pytest.raises(ValueError, match=r"'end\\' ends with a lone backslash"):
        unescape("end\\")


def test_cli_stop_with_escapes_as_typed(lm_checkpoint, decoderlab_cli):
    model, tok = dl.load_checkpoint(lm_checkpoint)
    ids = generate(model, tok.encode("to be"), 80, seed=3, stop="\n", tokenizer=tok)
    want = tok.decode(ids)
    r = decoderlab_cli("generate", "--checkpoint", lm_checkpoint, "--no-stream", "--seed", "3", "--max-new-tokens", "80",
                       "--stop", r"\n", "to be")
    assert (r.returncode, r.stdout, r.stderr) == (0, want + "\n", "")
    assert "\n" not in want
    r = decoderlab_cli("generate", "--checkpoint", lm_checkpoint, "--stop", r"\q", "to be")
    assert r.returncode == 2
    assert r.stderr == (r"decoderlab: error: --stop '\q' has an unknown escape \q; known escapes: \n \t \r \\ \0 "
                        r"\xHH \uHHHH (write \\ for a backslash)" + "\n")
    r = decoderlab_cli("generate", "--checkpoint", lm_checkpoint, "--stop", r"\n\u00e9", "to be")
    assert r.returncode == 2
    assert r.stderr.startswith(r"decoderlab: error: --stop '\n\u00e9' cannot be encoded by this model's tokenizer: "
                               "character '\u00e9' (U+00E9)")


def test_cli_passes_top_k_0_through(lm_checkpoint, capsys, monkeypatch):
    """--top-k 0 means "no top-k filter"; the CLI hands the 0 to the library unchanged."""
    import decoderlab.generation

    seen = {}

    def fake_stream_text(model, tok, prompt_ids, n, **kwargs):
        seen.update(kwargs)
        return iter([])

    monkeypatch.setattr(decoderlab.generation, "stream_text", fake_stream_text)
    assert cli_main(["generate", "--checkpoint", str(lm_checkpoint), "--no-stream", "--top-k", "0", "to be"]) == 0
    assert seen["top_k"] == 0


def test_cli_chat_commands_named_as_flags(statquest_checkpoint, decoderlab_cli):
    stdin = ("what is statquest\n/top-k 3\n/top_k 0\n/max-new-tokens 4\n/max_new_tokens x\n/top-p 0.9\n/help\n"
             "/quit\nwhat is statquest\n")
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stderr) == (0, "")
    out = r.stdout.splitlines()
    assert out[:6] == ["awesome", "(top-k = 3)", "(top_k off)", "(max-new-tokens = 4)",
                       "error: /max_new_tokens takes an integer >= 0, got 'x'", "(top-p = 0.9)"]
    assert out[6:] == CHAT_HELP.splitlines()  # and nothing after /quit
    for command in ("/top-k K", "/top-p P", "/max-new-tokens N", "/temperature T", "/reset", "/quit"):
        assert any(line.strip().startswith(command) for line in CHAT_HELP.splitlines()), command
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin="/exit\nwhat is statquest\n")
    assert (r.returncode, r.stdout) == (0, "")


# ---- issue 13: stop strings on text, control tokens, argument kinds, numerics, invalid Unicode, Ctrl-C -------


def bigram_model(num_tokens: int, next_of: dict[int, int], max_len: int = 64) -> dl.DecoderOnlyTransformer:
    """A model whose greedy choice is ``next_of[last token]``: identity word embeddings, attention that adds
    nothing (zero values), no positions, and a head that maps each token to its successor (logit 10, else 0)."""
    cfg = dl.preset("statquest", num_tokens=num_tokens, d_model=num_tokens, max_len=max_len, position="none")
    m = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():
        m.we.weight.copy_(torch.eye(num_tokens))
        m.blocks[0].attention.qkv.weight.zero_()
        m.fc_layer.weight.zero_()
        m.fc_layer.bias.zero_()
        for a, b in next_of.items():
            m.fc_layer.weight[b, a] = 10.0
    return m.eval()


@pytest.fixture(scope="module")
def newline_bpe():
    """A byte-level BPE that learned "\\n\\n" as one token (and "ab"), with a model that writes "\\n" after
    "a" and after "\\n" -- one newline token at a time, never the "\\n\\n" token -- and "x" -> "ab" -> "c" -> "\\n"."""
    tok = BPETokenizer.train(["ab ab abab pab\n\n" * 50 + "abc c p a b x\n\n"], 270)
    (nn,), (nl,) = tok.encode("\n\n"), tok.encode("\n")
    (a,), (ab,), (c,), (p,), (x,) = (tok.encode(s) for s in ("a", "ab", "c", "p", "x"))
    assert tok.decode([nn]) == "\n\n" and nn != nl
    model = bigram_model(tok.vocab_size, {p: a, a: nl, nl: nl, x: ab, ab: c, c: nl})
    return tok, model, dict(nl=nl, nn=nn, a=a, ab=ab, c=c, p=p, x=x)


def test_stop_string_matches_the_text_however_the_model_spells_it(newline_bpe):
    tok, model, ids = newline_bpe
    nl, a = ids["nl"], ids["a"]
    # the input: the model writes single "\n" tokens; the stop "\n\n" is one token of the vocabulary
    assert generate(model, "p", 6, temperature=0, tokenizer=tok) == [a] + [nl] * 5  # (no stop: six tokens)
    assert generate(model, "a", 6, temperature=0, stop="\n\n", tokenizer=tok) == []  # was six "\n"
    assert generate(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok) == [a]
    assert "".join(stream_text(model, tok, "p", 6, temperature=0, stop="\n\n")) == "a"
    assert list(stream(model, "p", 6, temperature=0, stop=["zz", "\n\n"], tokenizer=tok)) == [a]
    gen = stream(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok)
    assert next(gen) == a
    with pytest.raises(StopIteration) as end:
        next(gen)
    assert end.value.value == (nl, nl)  # the tokens that spelled the stop
    # with and without the cache, and in a batch (rows stop at different places)
    assert generate(model, "p", 6, temperature=0, stop="\n\n", tokenizer=tok, use_cache=False) == [a]
    assert generate_batch(model, ["p", "a", "ab"], 6, temperature=0, stop="\n\n", tokenizer=tok) == \
        [[a], [], [ids["c"]]]
    # token-id stops keep working next to text stops
    assert generate(model, "p", 6, temperature=0, stop=[a], tokenizer=tok) == []
    assert generate(model, "p", 6, temperature=0, stop=(a, nl), tokenizer=tok) == []
    assert generate(model, "p", 6, temperature=0, stop=[(nl, nl), "zz"], tokenizer=tok) == [a]


def test_stop_string_that_begins_inside_a_token(newline_bpe):
    """"ab" then "c": the stop "bc" begins inside the token "ab". The ids end before that token; the text ends
    exactly before the stop."""
    tok, model, ids = newline_bpe
    prompt = [ids["p"], ids["ab"]]  # continues "c", "\n", "\n", ...
    assert generate(model, prompt, 5, temperature=0, tokenizer=tok) == [ids["c"]] + [ids["nl"]] * 4
    assert generate(model, prompt, 5, temperature=0, stop="c\n\n", tokenizer=tok) == []
    assert "".join(stream_text(model, tok, prompt, 5, temperature=0, stop="\n\n")) == "c"
    # a stop that begins in the prompt's last token's text is not looked for in the prompt
    assert "".join(stream_text(model, tok, prompt, 5, temperature=0, stop="bc")) == "c\n\n\n\n"
    # "x" -> "ab", "c": the stop "bc" begins inside the generated token "ab"
    assert generate(model, "x", 5, temperature=0, tokenizer=tok)[:2] == [ids["ab"], ids["c"]]
    assert generate(model, "x", 5, temperature=0, stop="bc", tokenizer=tok) == []
    assert "".join(stream_text(model, tok, "x", 5, temperature=0, stop="bc")) == "a"
    assert "".join(stream_text(model, tok, "x", 5, temperature=0, stop="c\n")) == "ab"
    gen = stream(model, "x", 5, temperature=0, stop="bc", tokenizer=tok)
    with pytest.raises(StopIteration) as end:
        next(gen)
    assert end.value.value == (ids["ab"], ids["c"])
    # the matcher itself: "ab" is held ("b" may start "bc"); "c" completes the stop; the tail is "a"
    stops = Stops((), ["bc"], tok.decode)
    assert stops.push(ids["ab"]) == ([], None)
    assert stops.push(ids["c"]) == ([], (ids["ab"], ids["c"]))
    assert stops.tail == "a"


def test_stream_text_never_writes_what_becomes_a_stop(newline_bpe):
    tok, model, ids = newline_bpe
    for stop in ("\n\n", "a\n\n", "\n\n\n"):
        pieces = list(stream_text(model, tok, "p", 8, temperature=0, stop=stop))
        text = "a\n\n\n\n\n\n\n\n"
        assert "".join(pieces) == text[: text.index(stop)]


def test_cli_stop_string_in_a_subprocess(newline_bpe, tmp_path):
    """The real console script: --stop "\\n\\n" ends the output before the first blank line."""
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "ckpt", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab"))
    cmd = [exe, "generate", "--checkpoint", str(tmp_path / "ckpt"), "--temperature", "0", "--max-new-tokens", "6"]
    r = subprocess.run(cmd + ["--stop", "\n\n", "p"], capture_output=True, text=True, env=_env())
    assert (r.returncode, r.stdout, r.stderr) == (0, "a\n", "")  # was "a" and six newlines
    r = subprocess.run(cmd + ["--no-stream", "--echo", "--stop", "\n\n", "p"], capture_output=True, text=True,
                       env=_env())
    assert (r.returncode, r.stdout) == (0, "pa\n")


def _env():
    import os

    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def biased_char_model(tok, bias: dict[int, float], max_len: int = 32) -> dl.DecoderOnlyTransformer:
    """Every step draws from the same distribution: softmax of ``bias`` (0 for the other tokens)."""
    m = bigram_model(tok.vocab_size, {}, max_len=max_len)
    with torch.no_grad():
        for i, b in bias.items():
            m.fc_layer.bias[i] = b
    return m


def test_control_tokens_are_never_sampled_or_written_as_text(tmp_path):
    tok = CharTokenizer.from_text("hello world\n")
    pad, eos = tok.pad_id, tok.eos_id
    model = biased_char_model(tok, {pad: 3.0, eos: -1.0})  # <PAD> is the most probable token
    # without a tokenizer the engine cannot know <PAD> (the 24 in 2,000 were far fewer than here)
    assert generate(model, [2], 2000, seed=0).count(pad) > 500
    ids = generate(model, [2], 2000, seed=0, tokenizer=tok, stop_at_eos=False)
    assert len(ids) == 2000 and pad not in ids and ids.count(eos) > 5
    assert generate(model, [2], 50, seed=0, suppress_tokens=[pad, eos]).count(pad) == 0
    assert generate(model, [2], 50, temperature=0, tokenizer=tok, stop_at_eos=False)[0] != pad  # greedy too
    # <EOS> ends the text: the ids stop before it
    ids = generate(model, [2], 2000, seed=0, tokenizer=tok)
    assert eos not in ids and len(ids) < 2000
    full = generate(model, [2], 2000, seed=0, tokenizer=tok, stop_at_eos=False)
    assert ids == full[: full.index(eos)]
    # text output never shows a control token as text
    text = "".join(stream_text(model, tok, [2], 2000, seed=0, stop_at_eos=False))
    assert "<EOS>" not in text and "<PAD>" not in text
    assert text == tok.decode(full, skip_special=True)
    assert "".join(pieces_of(tok, [eos, 3, pad, 4, eos])) == tok.decode([3, 4])
    words = dl.lesson_tokenizer()
    assert words.decode([3, 4], skip_special=True) == "awesome" and words.special_ids == {4}
    # the CLI: `sample` ends at <EOS>, prints no control token
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm"})
    import subprocess

    exe = str(Path(sys.executable).with_name("decoderlab"))
    r = subprocess.run([exe, "sample", "--checkpoint", str(tmp_path / "c"), "--max-new-tokens", "2000", "--seed", "0",
                        "--prompt", "h"], capture_output=True, text=True, env=_env())
    assert r.returncode == 0 and r.stderr == ""
    want = "h" + "".join(stream_text(model, tok, "h", 2000, seed=0)) + "\n"
    assert r.stdout == want and "<" not in r.stdout


def test_numbers_of_any_kind_are_accepted():
    import numpy as np

    model = make_model("baby-shakespeare", "sdpa", seed=2)
    want = generate(model, [5], 12, temperature=0.7, top_k=3, top_p=0.9, seed=4, keep=6)
    for kinds in (dict(top_k=np.int64(3), temperature=np.float32(0.7), top_p=np.float64(0.9)),
                  dict(top_k=torch.tensor(3), temperature=torch.tensor(0.7, dtype=torch.float64),
                       top_p=torch.tensor(0.9, dtype=torch.float64)),
                  dict(top_k=3, temperature=0.7, top_p=0.9, seed=np.int64(4), keep=np.int32(6)),
                  dict(top_k=3, temperature=0.7, top_p=0.9, max_new_tokens=torch.tensor(12))):
        kw = dict(temperature=0.7, top_k=3, top_p=0.9, seed=4, keep=6, max_new_tokens=12, **{})
        kw.update(kinds)
        n = kw.pop("max_new_tokens")
        got = generate(model, [5], n, **kw)
        if kinds.get("temperature") is not None and isinstance(kinds["temperature"], np.float32):
            assert got == generate(model, [5], 12, temperature=float(np.float32(0.7)), top_k=3, top_p=0.9, seed=4,
                                   keep=6)
        else:
            assert got == want
    assert generate(model, np.array([5, 6]), 4, temperature=0) == generate(model, [5, 6], 4, temperature=0)
    assert generate(model, [5], 4, temperature=0, stop=np.int64(3)) == generate(model, [5], 4, temperature=0,
                                                                                   stop=3)
    # top_k=0 means no top-k filter (as in Hugging Face)
    assert generate(model, [5], 20, top_k=0, seed=4) == generate(model, [5], 20, seed=4)
    # still refused: bools, floats for integers, text, tensors with more than one value
    for bad in (True, 3.0, "3", torch.tensor([3, 4])):
        with pytest.raises(TypeError, match="top_k must be an integer >= 0"):
            generate(model, [5], 3, top_k=bad)
    with pytest.raises(TypeError, match="temperature must be a number >= 0"):
        generate(model, [5], 3, temperature="hot")


def test_stream_text_checks_its_arguments_at_the_call():
    model = make_model("statquest", "explicit")
    words = dl.lesson_tokenizer()
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0, got -1"):
        stream_text(model, words, "what", -1)  # not iterated
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        stream_text(model, words, "what", 3, top_p=2)
    with pytest.raises(KeyError, match="unknown word"):
        stream_text(model, words, "hello", 3)


def test_sampling_is_safe_at_the_extremes():
    inf = float("inf")
    g = [torch.Generator().manual_seed(0)]
    logits = torch.tensor([[1.0, 3.0, 2.0, -inf]])
    # a tiny temperature is the argmax (logits / 1e-30 overflow to inf: no NaN may drive the choice)
    for t in (1e-30, 1e-300, 5e-324):
        assert Sampler(temperature=t)(logits, g).tolist() == [1]
        assert Sampler(temperature=t, top_k=2, top_p=0.5)(logits, g).tolist() == [1]
    # huge logits, and +inf logits: only the +inf tokens can be chosen
    assert Sampler(temperature=1.0)(torch.tensor([[3e38, -3e38, 1e38]]), g).tolist() == [0]
    picks = {Sampler(temperature=0.5)(torch.tensor([[inf, 0.0, inf, -inf]]), g).item() for _ in range(50)}
    assert picks == {0, 2}
    assert Sampler(temperature=0)(torch.tensor([[0.0, inf, 1.0]]), []).tolist() == [1]
    # half-precision logits; a huge temperature is (close to) uniform
    assert Sampler(temperature=1e-20)(torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float16), g).tolist() == [1]
    draws = Sampler(temperature=1e30)(torch.tensor([[0.0, 50.0]]).expand(4000, 2), g * 4000)
    assert 1800 < int(draws.sum()) < 2200
    # no token possible, or NaN logits: a clear error, never a pick
    for bad in (torch.tensor([[-inf, -inf]]), torch.tensor([[0.0, float("nan")]])):
        for t in (0, 1.0, 1e-30):
            with pytest.raises(ValueError, match="NaN|every logit of a row is -inf"):
                Sampler(temperature=t)(bad, g)
    with pytest.raises(ValueError, match="every logit of a row is -inf"):
        Sampler(temperature=1.0, suppress=[0, 1])(torch.tensor([[5.0, 1.0]]), g)
    # end to end: a tiny temperature gives the greedy tokens
    model = make_model("gpt2", "sdpa", seed=1)
    assert generate(model, [3, 4], 15, temperature=1e-30, seed=0) == generate(model, [3, 4], 15, temperature=0)


def test_invalid_unicode_on_the_command_line(newline_bpe, lm_checkpoint, tmp_path):
    """$'para\\xff' (a byte that is not UTF-8; Python makes it U+DCFF): one error line and exit status 2 for
    every checkpoint kind and command; chat reports it and goes on."""
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "bpe", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab")).encode()
    for ckpt, commands in ((tmp_path / "bpe", ("generate", "sample", "stop", "explain", "verify")),
                           (lm_checkpoint, ("generate", "chat"))):
        for argv in ([b"generate", b"--checkpoint", bytes(ckpt), b"to be\xff"],
                     [b"sample", b"--checkpoint", bytes(ckpt), b"--prompt", b"to be\xff"],
                     [b"generate", b"--checkpoint", bytes(ckpt), b"--stop", b"\xff", b"to be"],
                     [b"explain", b"--checkpoint", bytes(ckpt), b"to be\xff"],
                     [b"verify", b"--checkpoint", bytes(ckpt), b"to be\xff"]):
            if (b"stop" if b"--stop" in argv else argv[0]).decode() not in commands:
                continue
            r = subprocess.run([exe, *argv], capture_output=True, env=_env())
            err = r.stderr.decode("utf-8", "backslashreplace")
            assert r.returncode == 2, (argv, err)
            assert err.count("\n") == 1 and err.startswith("decoderlab: error: "), (argv, err)
            assert "not valid Unicode: U+DCFF" in err and "0xff" in err, (argv, err)
        if "chat" not in commands:
            continue
        r = subprocess.run([exe, b"chat", b"--checkpoint", bytes(ckpt)], input=b"to be\xff\n", capture_output=True,
                           env=_env())
        assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr
        assert r.stdout.startswith(b"error: ") and (b"0xff" in r.stdout), r.stdout


def test_ctrl_c_keeps_what_was_produced(lm_checkpoint, capsys, monkeypatch):
    """Ctrl-C while `generate` / `sample` run: the text so far, one line on stderr, exit status 130."""
    model, tok = dl.load_checkpoint(lm_checkpoint)
    want = tok.decode(generate(model, "to be", 4, seed=13, tokenizer=tok))
    real_call = Sampler.__call__
    calls = []

    def interrupted(self, logits, generators):
        calls.append(1)
        if len(calls) == 5:  # during the fifth token
            raise KeyboardInterrupt
        return real_call(self, logits, generators)

    monkeypatch.setattr(Sampler, "__call__", interrupted)
    for command, out in (("generate", want + "\n"), ("sample", "to be" + want + "\n")):
        calls.clear()
        assert cli_main([command, "--checkpoint", str(lm_checkpoint), "--seed", "13", "--prompt", "to be"]) == 130
        got = capsys.readouterr()
        assert got.out == out
        assert got.err == f"decoderlab: interrupted ({command} stopped by Ctrl-C)\n"


def test_ctrl_c_in_a_subprocess(newline_bpe, tmp_path):
    """A real SIGINT to the console script while it streams: no traceback, one line, exit status 130."""
    import signal
    import subprocess

    tok, model, _ = newline_bpe
    save_checkpoint(tmp_path / "c", model, tok, meta={"task": "lm"})
    exe = str(Path(sys.executable).with_name("decoderlab"))
    proc = subprocess.Popen([exe, "generate", "--checkpoint", str(tmp_path / "c"), "--temperature", "0",
                             "--max-new-tokens", "100000000", "p"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env())
    try:
        first = proc.stdout.read(3)  # "a\n\n": it is generating
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert first == b"a\n\n"
    assert proc.returncode == 130
    assert err == b"decoderlab: interrupted (generate stopped by Ctrl-C)\n"
    assert set((first + out).decode()) <= {"a", "\n"}


def test_ctrl_c_in_chat(statquest_checkpoint, capsys, monkeypatch):
    """Ctrl-C during a reply stops the reply and the conversation goes on; at the prompt it leaves (130)."""
    model, tok = dl.load_checkpoint(statquest_checkpoint)
    real_call = Sampler.__call__
    calls = []

    def interrupted(self, logits, generators):
        calls.append(1)
        if len(calls) == 1:  # the first reply's first token
            raise KeyboardInterrupt
        return real_call(self, logits, generators)

    type_lines(monkeypatch, ["what is statquest", "statquest is what", KeyboardInterrupt])
    monkeypatch.setattr(Sampler, "__call__", interrupted)
    assert cli_main(["chat", "--checkpoint", str(statquest_checkpoint)]) == 130
    out = capsys.readouterr()
    assert out.out.splitlines() == ["(reply stopped)", "awesome"]
    assert out.err == "decoderlab: interrupted (chat stopped by Ctrl-C)\n"


# ---- inference dtypes (issue 12): float32 as trained, bfloat16, float16, int8 weight-only (torchao) ---------

DTYPE_TEXT = "to be, or not to be, that is the question:\nwhether 'tis nobler in the mind to suffer\n"


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A tiny shakespeare-char-family model trained (150 AdamW steps, ~1 s) until it recites DTYPE_TEXT: its
    logits have real margins, unlike random weights', so greedy agreement between dtypes means something."""
    tok = CharTokenizer.from_text(DTYPE_TEXT)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("shakespeare-char", num_tokens=tok.vocab_size, d_model=32,
                                                n_layer=2, n_head=2, max_len=32, dropout=0.0))
    ids = torch.tensor(tok.encode(DTYPE_TEXT))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        starts = torch.randint(0, len(ids) - 33, (8,))
        x = torch.stack([ids[s:s + 32] for s in starts])
        y = torch.stack([ids[s + 1:s + 33] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, tok.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5
    out = tmp_path_factory.mktemp("dtypes") / "ckpt"
    save_checkpoint(out, model, tok, meta={"task": "lm"})
    return out


# the largest |logit - float32 logit| allowed, as a share of max |float32 logit|, on trained_checkpoint's model
# (measured: bfloat16 1.1%, float16 0.13%, int8 0.9%; bfloat16 keeps 8 significant bits, float16 11)
DTYPE_TOLERANCE = {"bfloat16": 0.03, "float16": 0.005, "int8": 0.03}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_each_dtype_loads_and_generates_close_to_float32(trained_checkpoint, dtype):
    ref, tok = dl.load_checkpoint(trained_checkpoint)
    model, _ = dl.load_checkpoint(trained_checkpoint, dtype=dtype)
    fc = model.blocks[0].mlp.fc.weight
    if dtype == "int8":
        from torchao.quantization import Int8Tensor

        assert isinstance(fc, Int8Tensor) and fc.qdata.dtype == torch.int8
        assert model.fc_layer.weight.dtype == torch.float32  # the output layer (tied to the embedding) stays
    else:
        assert fc.dtype == getattr(torch, dtype) and model.fc_layer.weight is model.we.weight  # still tied
    x = torch.tensor(tok.encode(DTYPE_TEXT)[:32])
    with torch.no_grad():
        want, got = ref(x), model(x).float()
    if dtype == "float32":
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= DTYPE_TOLERANCE[dtype] * want.abs().max()
    prompt = tok.encode("to be")
    greedy = generate(model, prompt, 60, temperature=0)
    assert greedy == generate(ref, prompt, 60, temperature=0)  # a model that recites agrees in every dtype
    assert greedy == generate(model, prompt, 60, temperature=0, use_cache=False)
    sampled = generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)
    assert len(sampled) == 20 and sampled == generate(model, prompt, 20, temperature=0.8, top_k=5, seed=1)


def test_dtype_names_and_errors(trained_checkpoint, monkeypatch):
    from decoderlab.config import DTYPES as DTYPE_NAMES  # what --dtype's help lists
    from decoderlab.dtypes import DTYPES, dtype_name

    assert DTYPE_NAMES is DTYPES == ("float32", "bfloat16", "float16", "int8")
    assert [dtype_name(d) for d in (None, torch.float32, torch.bfloat16, torch.float16, torch.int8)] == \
        ["float32", "float32", "bfloat16", "float16", "int8"]
    for bad in ("fp16", torch.float64, 16):
        with pytest.raises(ValueError, match=r"unknown dtype .*; allowed: float32, bfloat16, float16, int8"):
            dl.load_checkpoint(trained_checkpoint, dtype=bad)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r'dtype int8 needs torchao .*pip install "decoderlab\[quant\]"'):
        dl.load_checkpoint(trained_checkpoint, dtype="int8")


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_cli_dtype_on_generate_sample_and_chat(trained_checkpoint, dtype, capsys, monkeypatch):
    model, tok = dl.load_checkpoint(trained_checkpoint, dtype=dtype)
    want = tok.decode(generate(model, tok.encode("to be"), 40, temperature=0))
    common = ["--checkpoint", str(trained_checkpoint), "--dtype", dtype, "--max-new-tokens", "40",
              "--temperature", "0"]
    assert cli_main(["generate", *common, "to be"]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert cli_main(["sample", *common, "to be"]) == 0
    assert capsys.readouterr().out == "to be" + want + "\n"
    type_lines(monkeypatch, ["to be"])
    assert cli_main(["chat", *common]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_bad_dtype_prints_one_error_line(trained_checkpoint):
    """The real console script: one ``decoderlab: error:`` line listing the choices, exit status 2."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    exe = shutil.which("decoderlab", path=str(Path(sys.executable).parent)) or shutil.which("decoderlab")
    for command in ("generate", "sample", "chat"):
        r = subprocess.run([exe, command, "--checkpoint", str(trained_checkpoint), "--dtype", "float8"],
                           capture_output=True, text=True, timeout=300, env=os.environ, stdin=subprocess.DEVNULL)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.splitlines() == ["decoderlab: error: unknown dtype 'float8'; allowed: float32, bfloat16, "
                                         "float16, int8"], command


def test_chat_command_errors_say_what_is_allowed(statquest_checkpoint, decoderlab_cli):
    """`/max-new-tokens abc` said "invalid literal for int() with base 10: 'abc'"; /seed and /top-k the same."""
    stdin = "/max-new-tokens abc\n/seed abc\n/seed -1\n/seed 99999999999999999999999\n/seed 5\n/top-k abc\n/top-k -2\n"
    r = decoderlab_cli("chat", "--checkpoint", statquest_checkpoint, stdin=stdin)
    assert (r.returncode, r.stderr) == (0, "")
    seed = "error: /seed takes an integer in 0 .. 2**63-1 (off: fresh entropy), got "
    top_k = "error: /top-k takes an integer >= 0 (0 or off: no top-k filter), got "
    assert r.stdout.splitlines() == ["error: /max-new-tokens takes an integer >= 0, got 'abc'", seed + "'abc'",
                                     seed + "'-1'", seed + "'99999999999999999999999'", "(seed = 5)",
                                     top_k + "'abc'", top_k + "'-2'"]


@pytest.mark.parametrize("argv, line", [
    (("generate", "--seed", "99999999999999999999999", "what"),
     "--seed must be an integer in 0 .. 2**63-1, got '99999999999999999999999' (see decoderlab generate --help)"),
    (("sample", "--seed=-1", "--prompt", "what"), "--seed must be an integer in 0 .. 2**63-1, got '-1' "
                                                   "(see decoderlab sample --help)"),
    (("chat", "--seed", str(2**63)), f"--seed must be an integer in 0 .. 2**63-1, got '{2**63}' "
                                     f"(see decoderlab chat --help)"),
])
def test_out_of_range_seeds_are_refused_in_one_line(statquest_checkpoint, decoderlab_cli, argv, line):
    """`--seed 99999999999999999999999` printed torch's "Overflow when unpacking long long"; -1 was accepted."""
    r = decoderlab_cli(argv[0], "--checkpoint", statquest_checkpoint, *argv[1:])
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"decoderlab: error: {line}\n")


def test_library_seed_checks_match_torch_generators():
    from decoderlab.generation.sampling import MAX_SEED, check_seed, make_generators

    assert MAX_SEED == 2**63 - 1 and check_seed(MAX_SEED) == MAX_SEED and check_seed(torch.tensor(3)) == 3
    torch.Generator().manual_seed(MAX_SEED + 1)  # torch takes more; a chat's seed + turn stays in its range
    for bad in (-1, 2**63, 99999999999999999999999):
        with pytest.raises(ValueError, match=rf"seed must be an integer in 0 \.\. 2\*\*63-1, got {bad}$"):
            make_generators(bad, 1, torch.device("cpu"))
    with pytest.raises(TypeError, match="seed must be an integer"):
        check_seed(1.5)
