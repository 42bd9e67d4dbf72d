"""decoderlab.load and Model: every method gives what the free function it wraps gives, on the lesson's model
and on a Hugging Face GPT-2 directory; repr; save -> load; the bad inputs a user makes."""

import pytest
import torch

import decoderlab as dl
from decoderlab.chat import chat_reply, stream_chat_reply
from decoderlab.checkpoint import load_checkpoint
from decoderlab.generation import generate, stream, stream_text

LESSON = "what is statquest <EOS>"


@pytest.fixture(scope="module")
def lesson(statquest_checkpoint):
    return dl.load(statquest_checkpoint)


def logits_of(m, ids):
    with torch.no_grad():
        return m.model(torch.tensor([ids]))


# -------------------------------------------------------------------------------------------------------------
# the lesson's model
# -------------------------------------------------------------------------------------------------------------


def test_lesson_generate_text_and_ids(lesson):
    model, tok = lesson.model, lesson.tokenizer
    assert lesson.generate(LESSON, temperature=0) == "awesome"
    assert lesson.generate(LESSON, temperature=0) == "".join(stream_text(model, LESSON, tok, temperature=0))
    ids = tok.encode(LESSON)
    assert lesson.generate(ids, temperature=0) == generate(model, ids, tokenizer=tok, temperature=0) == [3]
    # without the stop at <EOS>: "awesome <EOS>" and on, sampled with a seed, the same through both doors
    kw = dict(max_new_tokens=4, seed=7, stop_at_eos=False, temperature=1.5)
    assert lesson.generate(ids, **kw) == generate(model, ids, tokenizer=tok, **kw)
    assert lesson.generate(ids, temperature=0, stop_at_eos=False, max_new_tokens=2)[:2] == tok.encode("awesome <EOS>")
    assert lesson.generate(LESSON, **kw) == "".join(stream_text(model, LESSON, tok, **kw))
    assert lesson.generate(LESSON, 2, temperature=0) == lesson.generate(LESSON, dl.SamplingParams(max_new_tokens=2,
                                                                                                 temperature=0))


def test_lesson_stream(lesson):
    model, tok = lesson.model, lesson.tokenizer
    kw = dict(max_new_tokens=5, seed=3, stop_at_eos=False)
    assert list(lesson.stream(LESSON, **kw)) == list(stream_text(model, LESSON, tok, **kw))
    ids = tok.encode(LESSON)
    assert list(lesson.stream(ids, **kw)) == list(stream(model, ids, tokenizer=tok, **kw))


def test_lesson_chat(lesson):
    model, tok, template = lesson.model, lesson.tokenizer, lesson.template
    assert template == dl.TEMPLATES["lesson"]
    for prompt in ("what is statquest", "statquest is what"):
        messages = [{"role": "user", "content": prompt}]
        want = chat_reply(model, messages, tok, template, temperature=0)
        assert lesson.chat(prompt) == lesson.chat(messages) == want == "awesome"  # greedy: the template's default
        info = {}
        assert "".join(lesson.stream_chat(messages, info=info)) == "".join(
            stream_chat_reply(model, messages, tok, template, temperature=0))
        assert info["ended_with_end_of_turn"]
    kw = dict(temperature=2.0, seed=5, max_new_tokens=3)
    assert lesson.chat("what is statquest", **kw) == chat_reply(model, [{"role": "user", "content": "what is statquest"}],
                                                                tok, template, **kw)


def test_lesson_glass_box(lesson):
    model, tok = lesson.model, lesson.tokenizer
    mine, theirs = lesson.trace(LESSON), dl.trace(model, LESSON, tok)
    assert mine.tokens == theirs.tokens
    assert torch.equal(mine.layers[0].percents, theirs.layers[0].percents)
    assert torch.equal(mine.logits, theirs.logits)
    logits, cache = lesson.run_with_cache(LESSON)
    logits2, cache2 = dl.run_with_cache(model, LESSON, tokenizer=tok)
    assert torch.equal(logits, logits2) and sorted(cache.keys()) == sorted(cache2.keys())
    assert torch.equal(cache["blocks.0.attn.hook_pattern"], cache2["blocks.0.attn.hook_pattern"])
    report = lesson.verify(LESSON)
    assert report.ok and report.table() == dl.verify(model, tok.encode(LESSON)).table()
    assert lesson.explain(LESSON) == dl.explain(model, LESSON, tok)
    assert lesson.explain(LESSON, layer=0, top_k=2) == dl.explain(model, LESSON, tok, layer=0, top_k=2)


def test_lesson_tokens_config_repr(lesson):
    tok = lesson.tokenizer
    assert lesson.tokenize(LESSON) == tok.encode(LESSON) == [0, 1, 2, 4]
    assert lesson.detokenize([3, 4]) == tok.decode([3, 4]) == "awesome <EOS>"
    assert lesson.detokenize(torch.tensor([3, 4]), skip_special=True) == "awesome"
    assert lesson.config == lesson.model.config and lesson.config.d_model == 2
    assert lesson.device == torch.device("cpu") and lesson.dtype == torch.float32
    assert lesson.meta["task"] == "chat"
    r = repr(lesson)
    for part in ("statquest", "d_model=2", "n_layer=1", "n_head=1", "37 parameters", "template='lesson'",
                 "device=cpu", "dtype=float32", "tokenizer=word"):
        assert part in r, (part, r)


def test_lesson_save_load_round_trip(lesson, tmp_path):
    out = lesson.save(tmp_path / "copy")
    back = dl.load(out)
    ids = lesson.tokenize(LESSON)
    assert torch.equal(logits_of(back, ids), logits_of(lesson, ids))
    assert back.template == lesson.template and back.chat("what is statquest") == "awesome"
    assert back.meta["task"] == "chat" and str(out) in repr(back)


def test_in_memory_models_go_through_the_same_door(statquest_checkpoint):
    """An (model, tokenizer) pair -- here train_pairs()'s, as the README trains it -- wrapped by Model."""
    model, tok = dl.train_pairs()
    m = dl.Model(model, tok, template="lesson")
    assert m.chat("what is statquest") == "awesome" and m.generate(LESSON, temperature=0) == "awesome"
    assert "path=" not in repr(m) and "template='lesson'" in repr(m)
    loaded, _ = load_checkpoint(statquest_checkpoint)
    assert torch.equal(logits_of(m, m.tokenize(LESSON)), logits_of(dl.Model(loaded, tok), m.tokenize(LESSON)))
    assert dl.Model(model, tok).template is None  # a base language model: no chat template
    assert dl.Model.load(statquest_checkpoint).chat("statquest is what") == "awesome"


# -------------------------------------------------------------------------------------------------------------
# a Hugging Face GPT-2 directory
# -------------------------------------------------------------------------------------------------------------

CORPUS = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 4


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from decoderlab.hf import to_hf
    from decoderlab.tokenizers import BPETokenizer

    tok = BPETokenizer.train(CORPUS, 300)
    torch.manual_seed(0)
    model = dl.DecoderOnlyTransformer(dl.preset("gpt2", num_tokens=tok.vocab_size, d_model=32, n_layer=2, n_head=2,
                                                max_len=32)).eval()
    path = tmp_path_factory.mktemp("gpt2") / "tiny"
    to_hf(model, path, tokenizer=tok)
    return path


def test_gpt2_directory_methods_equal_the_free_functions(gpt2_dir):
    m = dl.load(gpt2_dir)
    model, tok = m.model, m.tokenizer
    text = "To be, or"
    kw = dict(max_new_tokens=6, seed=1, top_k=20, top_p=0.9, min_p=0.01)
    assert m.generate(text, **kw) == "".join(stream_text(model, text, tok, **kw))
    ids = m.tokenize(text)
    assert ids == tok.encode(text) and m.detokenize(ids) == text
    assert m.generate(ids, **kw) == generate(model, ids, tokenizer=tok, **kw)
    assert list(m.stream(ids, **kw)) == list(stream(model, ids, tokenizer=tok, **kw))
    assert torch.equal(m.trace(text).logits, dl.trace(model, text, tok).logits)
    assert torch.equal(m.run_with_cache(text)[0], dl.run_with_cache(model, text, tokenizer=tok)[0])
    assert m.verify(text).ok and m.verify(text).table() == dl.verify(model, text, tokenizer=tok).table()
    assert m.explain(text, layer=1) == dl.explain(model, text, tok, layer=1)
    r = repr(m)
    for part in ("gpt2-like", "d_model=32", "n_layer=2", "n_head=2", f"{model.num_parameters():,} parameters",
                 "template=None", "tokenizer=bpe", "device=cpu", "dtype=float32"):
        assert part in r, (part, r)


def test_a_block_model_s_repr_counts_its_weights_and_names_its_block_type(tmp_path):
    """A GGUF file loaded with --dtype q4_1 holds its matrices as q4_1 blocks (buffers, not parameters): its repr
    counts what the float model counts, says how many are in q4_1 blocks, and its dtype q4_1."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    bpe = byte_level_bpe(300)
    hf = hf_model("llama", bpe.get_vocab_size())
    path = write_gguf(tmp_path / "m.gguf", "llama", hf, bpe, qtype="Q4_1")
    floats, blocks = dl.load(path, dtype="float32"), dl.load(path, dtype="q4_1")
    n = sum(p.numel() for p in hf.parameters())  # the transformers model's (tied: counted once)
    matrices = sum(p.numel() for name, p in hf.named_parameters() if p.dim() == 2)
    assert floats.model.num_parameters() == blocks.model.num_parameters() == n
    assert blocks.model.num_parameters(non_embedding=True) == floats.model.num_parameters(non_embedding=True)
    assert f"; {n:,} parameters; " in repr(floats) and "dtype=float32" in repr(floats)
    assert f"; {n:,} parameters ({matrices:,} in q4_1 blocks); " in repr(blocks) and "dtype=q4_1" in repr(blocks)


def test_gpt2_directory_save_and_to_hf_round_trips(gpt2_dir, tmp_path):
    m = dl.load(gpt2_dir)
    ids = m.tokenize("whether 'tis nobler")
    m.to_hf(tmp_path / "hf")
    m.save(tmp_path / "ours")
    for back in (dl.load(tmp_path / "hf"), dl.load(tmp_path / "ours")):
        assert torch.equal(logits_of(back, ids), logits_of(m, ids))
        assert back.tokenizer.encode("whether 'tis nobler") == ids


def test_a_base_model_has_no_chat(gpt2_dir):
    with pytest.raises(ValueError, match=f"{gpt2_dir}.*no chat template.*generate"):
        dl.load(gpt2_dir).chat("hello")


def test_load_in_bfloat16(gpt2_dir):
    m = dl.load(gpt2_dir, dtype="bfloat16", device="cpu")
    assert m.dtype == torch.bfloat16 and "dtype=bfloat16" in repr(m)
    assert m.generate("To be", max_new_tokens=3, seed=0) == "".join(
        stream_text(m.model, "To be", m.tokenizer, max_new_tokens=3, seed=0))


def test_a_llama_directory_reads_a_text_with_its_start_token_and_its_chat_with_one(llama_directory):
    """Text in reads transformers' ``tokenizer(text)`` ids (<s> first, add_bos_token): tokenize, generate,
    trace; text out never shows <s>; the chat template writes its own <s> and nothing adds a second."""
    from hf.families import greedy_tokens

    path, hf, auto = llama_directory
    m = dl.load(path)
    text = "To be, or not to be"
    ids = auto(text)["input_ids"]
    assert m.tokenize(text) == ids and m.tokenize(text, add_special_tokens=False) == ids[1:] == m.tokenizer.encode(
        text)
    with pytest.raises(TypeError, match="add_special_tokens must be True or False, got 'no'"):
        m.tokenize(text, add_special_tokens="no")
    want = greedy_tokens(hf, ids, 8)
    assert m.generate(ids, 8, temperature=0, stop_at_eos=False) == want
    assert m.generate(text, 8, temperature=0, stop_at_eos=False) == auto.decode(want, skip_special_tokens=True)
    assert m.trace(text).token_ids[0].tolist() == ids and m.detokenize(ids, skip_special=True) == text
    messages = [{"role": "user", "content": text}]
    rendered, _ = m.template.render(messages, m.tokenizer, add_generation_prompt=True)
    assert rendered == auto.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert rendered.count(m.tokenizer.bos_id) == 1 and rendered[0] == m.tokenizer.bos_id
    reply = chat_reply(m.model, messages, m.tokenizer, m.template, max_new_tokens=8, temperature=0,
                       stop_at_eos=False)
    assert reply == auto.decode(greedy_tokens(hf, rendered, 8), skip_special_tokens=True)


# -------------------------------------------------------------------------------------------------------------
# bad inputs
# -------------------------------------------------------------------------------------------------------------


KINDS = "; a checkpoint is a decoderlab run or checkpoint directory, a Hugging Face directory or a .gguf file"


def test_missing_path_is_named(tmp_path):
    for where in (tmp_path / "no-such-run", tmp_path / "no-such.gguf"):
        with pytest.raises(FileNotFoundError) as e:
            dl.load(where)
        assert str(e.value) == f"checkpoint {where} does not exist{KINDS}"


def test_a_path_that_is_no_checkpoint_gets_the_one_message_of_every_command(tmp_path):
    """The front door's message is every --checkpoint's (tests/cli/test_options.py): a directory without
    config.json was "incomplete: missing config.json, model.safetensors, tokenizer.json", as if it were a
    decoderlab checkpoint; one missing its weights still is."""
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileNotFoundError) as e:
        dl.load(tmp_path)
    assert str(e.value) == f"checkpoint {tmp_path} is a directory without config.json{KINDS}"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileNotFoundError) as e:
        dl.load(tmp_path / "afile")
    assert str(e.value) == f"checkpoint {tmp_path / 'afile'} is a file but not a GGUF file (.gguf){KINDS}"
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*missing model.safetensors, tokenizer.json"):
        dl.load(tmp_path)


def test_an_unknown_sampling_keyword_is_named_with_the_known_ones(lesson):
    for call in (lambda: lesson.generate(LESSON, tempreature=0), lambda: lesson.generate([0, 1], tempreature=0),
                 lambda: lesson.stream(LESSON, tempreature=0), lambda: lesson.chat("what is statquest", tempreature=0)):
        with pytest.raises(TypeError, match="unknown sampling setting tempreature; known: max_new_tokens, "
                                            "temperature, top_k, top_p, min_p"):
            call()


def test_a_sampling_value_out_of_range_is_named(lesson):
    with pytest.raises(ValueError, match="top_p"):
        lesson.generate(LESSON, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lesson.chat("what is statquest", max_new_tokens=-1)


def test_bad_construction(lesson):
    with pytest.raises(TypeError, match="DecoderOnlyTransformer, got Linear"):
        dl.Model(torch.nn.Linear(2, 2), lesson.tokenizer)
    with pytest.raises(ValueError, match="vocabulary size 5 does not match the model's num_tokens 7"):
        dl.Model(dl.DecoderOnlyTransformer(num_tokens=7), lesson.tokenizer)
    with pytest.raises(ValueError, match="nope"):
        dl.Model(lesson.model, lesson.tokenizer, template="nope")


def test_the_lesson_model_cannot_become_gpt2(lesson, tmp_path):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="position='sinusoidal'"):
        lesson.to_hf(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_chat_with_tools_is_the_tool_loop():
    """Model.chat(tools=...) runs the calls through chat.run_tool_turn: the same reply, calls and finish reason
    (a tiny tools model pushed to call at every step, so the loop ends at max_tool_calls)."""
    import string

    from decoderlab.chat import TOOLS, add_chat_tokens, run_tool_turn

    torch.manual_seed(0)
    _, tok, _ = add_chat_tokens(None, dl.CharTokenizer(set(string.printable)), "tools")
    cfg = dl.preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2, max_len=400)
    m = dl.Model(dl.DecoderOnlyTransformer(cfg).eval(), tok, "tools")
    ask = [{"role": "user", "content": "What is 4821 * 377?"}]
    kw = dict(temperature=0, max_new_tokens=40, logit_bias={tok.token_to_id["<|tool_call|>"]: 100.0})
    want = run_tool_turn(m.model, tok, ask, "tools", TOOLS, max_calls=2, **kw)
    info: dict = {}
    assert m.chat(ask, tools="calculator", max_tool_calls=2, info=info, **kw) == want.content
    assert info["tool_calls"] == want.calls and info["finish_reason"] == "max_tool_calls" == want.finish_reason
    assert info["messages"] == want.messages
    with pytest.raises(ValueError, match="unknown tool 'abacus'; built-in tools: calculator"):
        m.chat(ask, tools=["abacus"])


def test_to_gguf_writes_the_export_functions_file(gpt2_dir, tmp_path):
    """Model.to_gguf is export.to_gguf: the same tensors, byte for byte, and the same summary."""
    gguf = pytest.importorskip("gguf")
    from decoderlab.export import to_gguf

    m = dl.load(gpt2_dir)
    ours = m.to_gguf(tmp_path / "m.gguf", dtype="float16")
    free = to_gguf(m.model, m.tokenizer, tmp_path / "f.gguf", dtype="float16", name=gpt2_dir.name)
    assert ours.pop("modelfile").endswith("m.Modelfile") and free.pop("modelfile").endswith("f.Modelfile")
    assert ours == free and ours["bytes"] > 0
    a, b = gguf.GGUFReader(str(tmp_path / "m.gguf")), gguf.GGUFReader(str(tmp_path / "f.gguf"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and (x.data == y.data).all(), x.name


def test_compile_keeps_the_greedy_tokens(gpt2_dir):
    """generate(compile=True) decodes through the compiled step and gives eager's greedy tokens (the eager
    backend here, so the test needs no C++ compiler; bench/generate.py times Inductor's)."""
    eager = dl.load(gpt2_dir)
    ids = eager.tokenize("To be, or")
    want = eager.generate(ids, max_new_tokens=8, temperature=0.0)
    m = dl.load(gpt2_dir).compile(backend="eager")
    assert m.model.compiled_decode is not None
    assert m.generate(ids, max_new_tokens=8, temperature=0.0, compile=True) == want


def test_compile_aot_switches_the_step_and_a_bad_compile_is_named(gpt2_dir, tmp_path):
    """compile(mode="aot") puts the ahead-of-time step in place (compiled on its first call, which
    tests/generation/test_aot.py makes); compile() after it goes back to Inductor's; generate(compile=...) takes
    False, True or "aot" only."""
    from decoderlab.aot import AOTDecodeStep

    m = dl.load(gpt2_dir).compile(mode="aot", cache_dir=tmp_path)
    step = m.model.compiled_decode
    assert isinstance(step, AOTDecodeStep) and step.cache_dir == tmp_path and not step.packages
    assert m.compile(mode="aot").model.compiled_decode is step  # (compiled once)
    assert not isinstance(m.compile().model.compiled_decode, AOTDecodeStep)
    with pytest.raises(ValueError, match="compile must be False, True or 'aot', got 'fast'"):
        m.generate("To be", max_new_tokens=2, compile="fast")


def test_features_are_the_glass_box_token_features(lesson, tmp_path):
    """Model.features(sae, hook, text) equals glassbox.features.token_features, from a loaded SAE or its
    directory (SAELens's files)."""
    from decoderlab.glassbox.features import token_features
    from decoderlab.glassbox.sae import SparseAutoencoder

    d_model = lesson.config.d_model
    sae = SparseAutoencoder(d_model, 4 * d_model, 2, seed=0)
    hook = "blocks.0.hook_resid_post"
    text = "what is statquest <EOS>"
    want = token_features(lesson.model, sae, hook, lesson.tokenize(text), top=3, tokenizer=lesson.tokenizer)
    assert lesson.features(sae, hook, text, top=3) == want
    sae.save(tmp_path / "sae")
    assert lesson.features(tmp_path / "sae", hook, text, top=3) == want
