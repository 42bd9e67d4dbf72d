"""Where a fine-tuning run starts: a Hugging Face GPT-2 directory as the base, and defaults that fit the start
(a base's gentle learning rate, a preset's training recipe from scratch, the lesson's optimizer with the
``lesson`` template)."""

import json

import pytest
import torch
from tiny_runs import CONVS, one_thread, tiny_cfg  # noqa: F401  (one_thread: an autouse fixture)

from decoderlab.chat import load_model
from decoderlab.config import FINETUNE_TRAIN, LESSON_FINETUNE, RECIPES, TRAIN_DEFAULTS, finetune_defaults, recipe_of
from decoderlab.finetuning import finetune
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import BPETokenizer

pytest.importorskip("transformers")


def test_a_hugging_face_gpt2_directory_is_a_base(tmp_path):
    from decoderlab.hf import to_hf

    text = " ".join(m["content"] for c in CONVS for m in c)
    tok = BPETokenizer.train([text * 3], 300)
    torch.manual_seed(0)
    base = DecoderOnlyTransformer(preset("gpt2", num_tokens=tok.vocab_size, d_model=16, n_layer=1, n_head=2,
                                         max_len=64, d_ff=32))
    to_hf(base, tmp_path / "gpt2", tokenizer=tok)
    _, _, s = finetune(CONVS, out=tmp_path / "run", checkpoint=tmp_path / "gpt2", train_config=tiny_cfg(max_steps=2),
                       val_fraction=0, eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False,
                       accelerator="cpu")
    assert s.steps == 2 and s.template == "decoderlab" and s.added_tokens  # the template's tokens were added
    loaded = load_model(tmp_path / "run")
    assert loaded.template.name == "decoderlab" and loaded.model.config.num_tokens == tok.vocab_size + len(s.added_tokens)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["checkpoint"] == str((tmp_path / "gpt2").resolve())


def test_defaults_fit_the_start():
    assert finetune_defaults() == FINETUNE_TRAIN  # a base: the gentle learning rate that keeps its knowledge
    recipe = recipe_of("baby-shakespeare")
    assert recipe is not None and recipe in RECIPES.values()
    scratch = finetune_defaults("baby-shakespeare")
    assert scratch["lr"] == recipe.train.get("lr", TRAIN_DEFAULTS["lr"]) != FINETUNE_TRAIN["lr"]
    assert scratch["max_steps"] == FINETUNE_TRAIN["max_steps"]  # only the optimizer's settings come from the recipe
    for start in (dict(template="lesson"), dict(preset="statquest")):
        lesson = finetune_defaults(**start)
        assert {k: lesson[k] for k in LESSON_FINETUNE} == LESSON_FINETUNE


def test_the_lesson_template_from_scratch_learns_with_the_lesson_s_optimizer_without_flags(tmp_path):
    data = [[{"role": "user", "content": q}, {"role": "assistant", "content": "awesome"}]
            for q in ("what is statquest", "statquest is what")]
    _, _, s = finetune(data, out=tmp_path / "run", preset="statquest", tokenizer="word", template="lesson",
                       val_fraction=0, config_overrides={"max_steps": 60, "eval_every": 60}, progress_bar=False,
                       logger=False, accelerator="cpu")
    cfg = json.loads((tmp_path / "run" / "run.json").read_text())["train_config"]
    assert cfg["lr"] == LESSON_FINETUNE["lr"] and cfg["grad_clip"] == LESSON_FINETUNE["grad_clip"]
    assert s.evaluation["exact_match"] == 1.0, s.evaluation


def test_a_character_vocabulary_built_for_the_tools_template_holds_its_json_characters(tmp_path):
    """A char-level model fine-tuned from scratch with the tools template could serve calls only if its data
    happened to hold every JSON character: the template's own characters are in the vocabulary it builds."""
    from tiny_runs import TINY_CHAT, conv, tiny_cfg

    from decoderlab.chat import get_template
    from decoderlab.finetuning import finetune

    data = [conv("hi", "ho"), conv("say yes", "yes")]  # no brace, quote, colon, comma or digit
    _, tok, _ = finetune(data, out=tmp_path / "r", preset="baby-shakespeare", template="tools",
                         model_overrides=dict(TINY_CHAT, max_len=64), train_config=tiny_cfg(), val_fraction=0,
                         eval_prompts=0, progress_bar=False, logger=False, accelerator="cpu")
    assert set(get_template("tools").text_characters) <= set(tok.token_to_id)
    assert tok.encode('say {"a": 12, "e": [3.5, -1]}')


def test_a_gguf_file_is_a_base_with_its_own_template(tmp_path):
    """A GGUF file (llama.cpp's) as the base: dequantized to float32, its tokenizer.chat_template the run's
    template (no token added: the file's control tokens are the template's), the checkpoint written with it."""
    pytest.importorskip("gguf")
    from support.gguf_files import CHATML, byte_level_bpe, hf_model, write_gguf

    bpe = byte_level_bpe(300, texts=[" ".join(m["content"] for c in CONVS for m in c) * 3])
    path = write_gguf(tmp_path / "base.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q8_0")
    _, _, s = finetune(CONVS, out=tmp_path / "run", checkpoint=path, train_config=tiny_cfg(max_steps=2),
                       val_fraction=0, eval_prompts=1, eval_max_new_tokens=2, progress_bar=False, logger=False,
                       accelerator="cpu")
    assert s.steps == 2 and s.template == "gguf:base" and s.added_tokens == []
    loaded = load_model(tmp_path / "run")
    assert loaded.template.source == CHATML and loaded.model.config.mlp == "swiglu"
