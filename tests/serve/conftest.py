"""Fixtures of the server's tests: a real uvicorn on a free port serving the tiny model (``server``: a base
model; ``chat_server``: with a chat template, an API key and CORS; ``tools_server``: an untrained model with the
"tools" chat template and a printable-character vocabulary, for tool calls and structured output;
``hermes_server``: an untrained model with a Hugging Face template that writes calls as <tool_call> blocks;
``smollm2_server``: SmolLM2-Instruct's template, which writes none, and a model that calls the calculator)."""

from __future__ import annotations

import string

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import add_chat_tokens, get_template

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("httpx")

from decoderlab.serve import Limits, ServerThread, create_app  # noqa: E402

from .helpers import MODEL_ID, FakeTemplate, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def mt():
    return tiny_model()


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=None,
                     limits=Limits(max_tokens=3000, max_n=3, max_messages=8, max_body_bytes=100_000))
    with ServerThread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def chat_server(mt):
    model, tok = mt
    app = create_app(model, tok, model_id=MODEL_ID, template=FakeTemplate(), api_key="sekret",
                     cors_origins=["http://example.test"], limits=Limits(max_messages=8))
    with ServerThread(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def tools_model():
    torch.manual_seed(0)
    _, tok, _ = add_chat_tokens(None, dl.CharTokenizer(set(string.printable)), "tools")
    # a long context: the tools' definitions are rendered into the prompt, one token per character
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=640)
    return dl.DecoderOnlyTransformer(cfg).eval(), tok


@pytest.fixture(scope="module")
def tools_server(tools_model):
    model, tok = tools_model
    app = create_app(model, tok, model_id=MODEL_ID, template=get_template("tools"), limits=Limits(max_tokens=200))
    with ServerThread(app) as url:
        yield url


#: the Hugging Face templates that write tool calls as <tool_call> blocks, by name: decoderlab's and Qwen2.5's
HERMES_TEMPLATES = ("chatml-tools", "qwen2.5")


@pytest.fixture(scope="module", params=HERMES_TEMPLATES)
def hermes_server(request):
    """An untrained model on a byte-level BPE with ChatML's control tokens and <tool_call> / </tool_call> as
    ordinary added tokens (Qwen's tokenizer), served with a Jinja template that writes calls as text:
    ``(url, model, tokenizer, template, transformers' tokenizer of the same vocabulary and template)``."""
    from hf_chat_templates import CHATML_TOKENS, QWEN25, bpe_pair

    from decoderlab.chat import JinjaChatTemplate, get_template

    source = QWEN25 if request.param == "qwen2.5" else get_template(request.param).source
    tok, theirs = bpe_pair(CHATML_TOKENS, ["<tool_call>", "</tool_call>"], chat_template=source)
    template = JinjaChatTemplate(source, name=request.param)
    torch.manual_seed(0)
    # a long context: the tools' definitions are rendered into the system turn, about a token per character
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=2048)
    model = dl.DecoderOnlyTransformer(cfg).eval()
    app = create_app(model, tok, model_id=MODEL_ID, template=template, limits=Limits(max_tokens=200))
    with ServerThread(app) as url:
        yield url, model, tok, template, theirs


@pytest.fixture(scope="module")
def smollm2_server():
    """SmolLM2-Instruct's own template, which writes no tool calls, on a byte-level BPE with ChatML's control tokens
    only (as SmolLM2's: <tool_call> is spelled in pieces), and a bigram model that opens a calculator call in
    those pieces after the generation prompt and, under the call's grammar, writes the expression "12+7":
    ``(url, model, tokenizer, transformers' tokenizer of the same vocabulary with SmolLM2's template)``."""
    import warnings

    from hf_chat_templates import CHATML_TOKENS, CORPUS, SMOLLM2, bpe_pair
    from tiny_models import bigram_model

    from decoderlab.chat import TOOLS, JinjaChatTemplate

    with warnings.catch_warnings():  # (the text offers fewer merges than asked for: said, and wanted)
        warnings.simplefilter("ignore", UserWarning)
        # all the merges of a corpus that holds the opener: "<", "tool", "_", "call", ">", five distinct pieces
        tok, theirs = bpe_pair(CHATML_TOKENS, chat_template=SMOLLM2, vocab_size=420, corpus=CORPUS + "<tool_call>\n")
    ids, _ = get_template("chatml-tools").render([{"role": "user", "content": "What is 12 + 7?"}], tok,
                                                 add_generation_prompt=True, tools=[TOOLS["calculator"].definition])
    opener = tok.encode("<tool_call>")
    assert len(set(opener)) == len(opener) > 1 and ids[-1] not in opener
    one, two, plus, seven, quote = (tok.token_to_id[c] for c in '12+7"')
    next_of = {i: one for i in range(tok.vocab_size) if tok.decode([i]).endswith('"')}
    next_of.update({one: two, two: plus, plus: seven, seven: quote})
    next_of.update(zip([ids[-1], *opener[:-1]], opener))  # the opener, piece by piece, after the prompt
    model = bigram_model(tok.vocab_size, next_of, max_len=2048)
    app = create_app(model, tok, model_id=MODEL_ID, template=JinjaChatTemplate(SMOLLM2, name="smollm2"),
                     limits=Limits(max_tokens=200))
    with ServerThread(app) as url:
        yield url, model, tok, theirs


@pytest.fixture(scope="module")
def llama_server(llama_directory):
    """A tiny Llama 2 / TinyLlama-style Hugging Face directory (``<s>`` before a text, a chat template that
    writes its own) served as ``decoderlab serve`` serves it: ``(url, the decoderlab Model, the transformers
    model, the AutoTokenizer)``."""
    path, hf, auto = llama_directory
    m = dl.load(path)
    app = create_app(m.model, m.tokenizer, model_id=MODEL_ID, template=m.template, limits=Limits(max_tokens=100))
    with ServerThread(app) as url:
        yield url, m, hf, auto
