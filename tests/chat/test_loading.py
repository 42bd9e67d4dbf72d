"""The one loader: model, tokenizer, template and meta of a checkpoint together; old checkpoints of the lesson's
pair training load as the lesson's template."""

from decoderlab.chat import TEMPLATES, chat_reply, load_model, template_from_meta
from decoderlab.checkpoint import load_checkpoint, read_meta, save_checkpoint


def test_old_checkpoints_still_load(statquest_checkpoint, tmp_path):
    """Checkpoints written before chat templates: a language model's loads as a base model (no template, no added
    tokens); one of the lesson's pair training ("task": "pairs", no template) as the lesson's template."""
    model, tok = load_checkpoint(statquest_checkpoint)
    old_lm = save_checkpoint(tmp_path / "lm", model, tok, meta={"task": "lm"})
    assert tok.added_special_tokens == [] and template_from_meta(read_meta(old_lm)) is None
    old_pairs = save_checkpoint(tmp_path / "pairs", model, tok, meta={"task": "pairs"})
    loaded = load_model(old_pairs)
    assert loaded.template == TEMPLATES["lesson"] and loaded.tokenizer.added_special_tokens == []
    for prompt in ("what is statquest", "statquest is what"):
        reply = chat_reply(loaded.model, [{"role": "user", "content": prompt}], loaded.tokenizer, loaded.template,
                           temperature=0)
        assert reply == "awesome"


def test_the_lesson_checkpoint_loads_with_its_template(statquest_checkpoint):
    """train_pairs stores the lesson's template: the one loader gives model, tokenizer, template and meta, and
    the lesson's prompts are answered through the chat path ("awesome", then the end of turn)."""
    model, tok, template, meta = load_model(statquest_checkpoint)
    assert template == TEMPLATES["lesson"] and meta["task"] == "chat" and model.num_parameters() == 37
    for prompt in ("what is statquest", "statquest is what"):
        info = {}
        reply = chat_reply(model, [{"role": "user", "content": prompt}], tok, template, temperature=0, info=info)
        assert (reply, info["ended_with_end_of_turn"]) == ("awesome", True)
        assert tok.decode(info["prompt_ids"] + info["reply_ids"]) == f"{prompt} <EOS> awesome"  # (the end not a reply id)


def test_a_gguf_file_loads_with_its_own_chat_template(tmp_path):
    """A GGUF file through the one loader: its tokenizer.chat_template as a Jinja template whose ids equal
    transformers' apply_chat_template on the file's tokenizer, the end of turn found, chat replies decoded, and
    meta["gguf"] saying what was dequantized."""
    import pytest

    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    from support.gguf_files import CHATML, byte_level_bpe, hf_model, write_gguf

    from decoderlab.chat import JinjaChatTemplate

    bpe = byte_level_bpe(300)
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2", hf_model("qwen2", bpe.get_vocab_size()), bpe, qtype="Q8_0")
    model, tok, template, meta = load_model(path)
    assert isinstance(template, JinjaChatTemplate) and template.source == CHATML and template.name == "gguf:tiny"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
    ids, _ = template.render(messages, tok, add_generation_prompt=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ids == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert template.end_of_turn_id(tok) == tok.token_to_id["<|im_end|>"]
    reply = chat_reply(model, messages, tok, template, temperature=0, max_new_tokens=5)
    assert isinstance(reply, str)
    assert meta["gguf"]["architecture"] == "qwen2" and meta["gguf"]["dequantized"]["kept"]["Q8_0"] > 0


def test_a_directory_s_own_jinja_template_is_its_template(statquest_checkpoint, tmp_path):
    """Without a template in meta.json, a directory's Hugging Face chat template (chat_template.jinja, or
    tokenizer_config.json's chat_template) is the one the loader and a fine-tune from it use; meta.json's wins."""
    from decoderlab.chat import JinjaChatTemplate, checkpoint_template
    from decoderlab.finetuning.start import base_template

    model, tok = load_checkpoint(statquest_checkpoint)
    lm = save_checkpoint(tmp_path / "lm", model, tok, meta={"task": "lm"})
    assert checkpoint_template(lm) is None
    (lm / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }} <EOS> {% endfor %}",
                                            encoding="utf-8")
    loaded = load_model(lm)
    assert loaded.template == JinjaChatTemplate((lm / "chat_template.jinja").read_text(), name="jinja:lm")
    assert base_template(lm) == loaded.template
    assert checkpoint_template(statquest_checkpoint) == TEMPLATES["lesson"]
