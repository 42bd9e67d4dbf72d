"""Tiny models and tokenizers the generation, CLI and server tests build (imported by those tests; the fixtures
that use them are in conftest.py).

Exactness is tested on float64 models, so that equal math gives equal argmax/samples with no float32 ties.
"""

import os
from pathlib import Path

import pytest
import torch

import decoderlab as dl
from decoderlab.generation import TextStreamer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread avoids waiting on a second one when the machine is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Every preset family, shrunk (same norm/position/mlp/bias/tying choices), plus rope/rmsnorm, no positions and the
# Llama family's shape (grouped-query attention, SwiGLU, Hugging Face's rotate-half rope with its own base, Qwen2's
# q/k/v biases, Qwen3's QK-norm with a gain, heads narrower than d_model / n_head).
FAMILIES = {
    "statquest": dict(),
    "baby-shakespeare": dict(d_model=16, n_layer=2, n_head=4, max_len=12),
    "shakespeare-char": dict(d_model=24, n_layer=2, n_head=6, max_len=10),
    "gpt2": dict(num_tokens=97, d_model=16, n_layer=2, n_head=2, max_len=12),
    "rope-rmsnorm": dict(d_model=16, n_layer=2, n_head=2, max_len=9, position="rope", norm="rmsnorm"),
    "no-positions": dict(d_model=16, n_layer=1, n_head=2, max_len=8, position="none"),
    "llama-gqa": dict(d_model=16, n_layer=2, n_head=4, n_kv_head=2, head_dim=6, max_len=12, position="rope",
                      rope_layout="rotate_half", rope_theta=500.0, norm="rmsnorm", mlp="swiglu", d_ff=24,
                      tie_weights=False, qkv_bias=True, qk_norm=True, qk_norm_gain=True),
    # Gemma 3's shape: two sliding layers (window 3 of max_len 12, their own rope base) around a full one, norms
    # after attention and the MLP, GeGLU, a scaled embedding, 1 / sqrt(6) attention, multi-query heads of 8
    "gemma-sliding": dict(d_model=16, n_layer=3, n_head=4, n_kv_head=1, head_dim=8, max_len=12, position="rope",
                          rope_layout="rotate_half", rope_theta=500.0, rope_local_theta=50.0, sliding_window=3,
                          layer_types=("sliding_attention", "full_attention", "sliding_attention"), norm="rmsnorm",
                          sandwich_norm=True, mlp="geglu", d_ff=24, embed_scale=True, query_pre_attn_scalar=6.0,
                          qk_norm=True, qk_norm_gain=True, tie_weights=True, lm_head_bias=False),
}


def make_model(family: str, kernel: str, seed: int = 0) -> dl.DecoderOnlyTransformer:
    torch.manual_seed(seed)
    base = "baby-shakespeare" if family in ("rope-rmsnorm", "no-positions", "llama-gqa", "gemma-sliding") else family
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


def biased_char_model(tok, bias: dict[int, float], max_len: int = 32) -> dl.DecoderOnlyTransformer:
    """Every step draws from the same distribution: softmax of ``bias`` (0 for the other tokens)."""
    m = bigram_model(tok.vocab_size, {}, max_len=max_len)
    with torch.no_grad():
        for i, b in bias.items():
            m.fc_layer.bias[i] = b
    return m


def run_env() -> dict:
    """The environment for a subprocess running this checkout's decoderlab (src/ first on PYTHONPATH)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


def end_of_turn_model():
    """A chat checkpoint's shape: a character tokenizer with the decoderlab chat template's tokens, and a
    model that writes "bc" after "a" and then the end of turn ``<|end|>`` (then "a" again, and so on); after
    the assistant opener it writes "a" (a chat reply "abc")."""
    from decoderlab.chat import TEMPLATES

    tok = dl.CharTokenizer.from_text("abc").add_special_tokens(TEMPLATES["decoderlab"].special_tokens)
    a, b, c = tok.encode("abc")
    end, opener = tok.token_to_id["<|end|>"], tok.token_to_id["<|assistant|>"]
    model = bigram_model(tok.vocab_size, {a: b, b: c, c: end, end: a, opener: a})
    return tok, model, dict(a=a, b=b, c=c, end=end)


CHARS = "abcdefghijklmnopqrstuvwxyz ,.:!?\n"


def tiny_model(family: str = "baby-shakespeare"):
    """The server tests' model: a random float32 character model, sharpened a little, <EOS> rare (long
    replies); ``family="llama-gqa"`` the Llama family's shape (grouped-query attention, SwiGLU, rotate-half rope,
    q/k/v biases, QK-norm gains), ``"gemma-sliding"`` Gemma's (a sliding layer of window 3, then a full one)."""
    torch.manual_seed(0)
    tok = dl.CharTokenizer.from_text(CHARS)
    shape = {} if family == "baby-shakespeare" else {**FAMILIES[family], "d_model": 32, "max_len": 32}
    if shape.get("layer_types"):  # (two layers: a sliding one, then a full one)
        shape["layer_types"] = ("sliding_attention", "full_attention")
    cfg = dl.preset("baby-shakespeare", **{**shape, "n_layer": 2, "n_head": shape.get("n_head", 2), "d_model": 32,
                                           "max_len": 32, "num_tokens": tok.vocab_size})
    cfg.lm_head_bias = True
    model = dl.DecoderOnlyTransformer(cfg)
    with torch.no_grad():  # sharpen the random model a little, and make <EOS> rare (long replies)
        model.fc_layer.weight.mul_(4.0)
        model.fc_layer.bias.zero_()
        model.fc_layer.bias[tok.eos_id] = -30.0
    model.eval()
    return model, tok


#: the JSON records the small structured-output model is trained on, and the schema they follow
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
                 "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                "pets": {"type": "array", "maxItems": 3,
                                         "items": {"type": "string", "enum": ["cat", "dog", "fish"]}}}}
JSON_CHARS = '{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz\n'


def person_records(n: int, seed: int = 0) -> list[str]:
    import json
    import random

    rng = random.Random(seed)
    names = ["ann", "bob", "cid", "dora", "eve", "finn", "gus", "hana", "ivo", "jo"]
    return [json.dumps({"name": rng.choice(names), "age": rng.randrange(100),
                        "pets": rng.sample(["cat", "dog", "fish"], rng.randrange(4))}) for _ in range(n)]


def trained_json_model(steps: int = 150, seed: int = 0):
    """A small character model (2 layers, d_model 32) trained for ``steps`` AdamW steps on lines of
    ``person_records``: it writes records like them (about 2 s on one thread)."""
    torch.manual_seed(seed)
    tok = dl.CharTokenizer(set(JSON_CHARS))
    text = "\n".join(person_records(400, seed)) + "\n"
    data = torch.tensor(tok.encode(text))
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=32, n_layer=2, n_head=2, max_len=64)
    model = dl.DecoderOnlyTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (16,), generator=g)
        x = torch.stack([data[s:s + 64] for s in starts])
        y = torch.stack([data[s + 1:s + 65] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), tok
