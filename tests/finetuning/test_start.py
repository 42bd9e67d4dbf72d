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


def test_a_smollm2_base_fine_tuned_on_tool_calls_is_given_chatml_tools_which_its_exports_carry(tmp_path):
    """SmolLM2-Instruct's ChatML writes no tool calls (it would drop them from the text trained on): a run whose
    conversations hold calls takes chatml-tools (the same text for the others), stores it, and its GGUF and
    Hugging Face exports carry it as tokenizer.chat_template / tokenizer_config.json's chat_template."""
    pytest.importorskip("gguf")
    from hf_chat_templates import SMOLLM2
    from support.gguf_files import byte_level_bpe, field, hf_model, read_back, write_gguf

    from decoderlab.chat import CHATML_TOOLS
    from decoderlab.export import export

    call = {"id": "call_0", "type": "function", "function": {"name": "calculator",
                                                             "arguments": {"expression": "2 + 3"}}}
    calling = [{"role": "user", "content": "what is 2 + 3?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_0", "content": "5"}, {"role": "assistant", "content": "5"}]
    bpe = byte_level_bpe(300, texts=[" ".join(m["content"] for c in CONVS for m in c) * 3])
    model = hf_model("llama", bpe.get_vocab_size(), max_position_embeddings=512)  # (SmolLM2's system message)
    path = write_gguf(tmp_path / "base.gguf", "llama", model, bpe, chat_template=SMOLLM2)
    _, _, s = finetune(CONVS + [calling], out=tmp_path / "run", checkpoint=path, train_config=tiny_cfg(max_steps=1),
                       val_fraction=0, eval_prompts=0, progress_bar=False, logger=False, accelerator="cpu")
    assert s.template == "chatml-tools" and s.added_tokens == []  # (its tokens are SmolLM2's)
    loaded = load_model(tmp_path / "run")
    assert loaded.template.source == CHATML_TOOLS and loaded.template.tool_call_format == "hermes"
    export(tmp_path / "run", tmp_path / "out.gguf", format="gguf")
    assert field(read_back(tmp_path / "out.gguf")[1], "tokenizer.chat_template") == CHATML_TOOLS
    export(tmp_path / "run", tmp_path / "hf", format="hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == CHATML_TOOLS


def block_file(tmp_path):
    """A tiny Llama GGUF file of q8_0 blocks with ChatML's tokens (no token added by the run)."""
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    bpe = byte_level_bpe(300, texts=[" ".join(m["content"] for c in CONVS for m in c) * 3])
    return write_gguf(tmp_path / "base.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q8_0")


def lora_over(path, out, steps=4, **kw):
    return finetune(CONVS, out=out, checkpoint=path, val_fraction=0, eval_prompts=0, progress_bar=False, logger=False,
                    accelerator="cpu", lora={"rank": 2, "alpha": 4, "targets": ["attn", "mlp"]},
                    **{"train_config": tiny_cfg(max_steps=steps, batch_size=4, lr=1e-2), **kw})


def test_a_lora_run_over_a_gguf_files_blocks_resumes_exactly_and_float32_keeps_the_float_base(tmp_path, capsys):
    """A LoRA run on a GGUF file trains over its blocks by default (QLoRA-style: run.json's base_dtype "auto",
    the note says so); Ctrl-C at step 3 and a resume give the uninterrupted run's adapter bit for bit (the base is
    rebuilt in its blocks); ``dtype="float32"`` trains over the dequantized float base, to nearly the same adapter;
    a resume with another base dtype, and a dtype that is not a base's, are refused by name."""
    pytest.importorskip("gguf")
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from support.interaction import InterruptAt

    from decoderlab.training import TrainingInterrupted

    path = block_file(tmp_path)
    lora_over(path, tmp_path / "whole")
    assert "on attn,mlp over the base's q8_0 blocks" in capsys.readouterr().err
    assert json.loads((tmp_path / "whole" / "run.json").read_text())["base_dtype"] == "auto"
    with pytest.raises(TrainingInterrupted):
        lora_over(path, tmp_path / "cut", callbacks=[InterruptAt(3)])
    lora_over(None, tmp_path / "cut", resume=True, train_config=None)
    adapter = {run: load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors"))
               for run in ("whole", "cut")}
    assert adapter["whole"].keys() == adapter["cut"].keys()
    assert all(torch.equal(adapter["whole"][k], adapter["cut"][k]) for k in adapter["whole"])
    lora_over(path, tmp_path / "float", dtype="float32")
    assert "over a float32 base" in capsys.readouterr().err
    assert json.loads((tmp_path / "float" / "run.json").read_text())["base_dtype"] == "float32"
    flt = load_file(str(tmp_path / "float" / "adapter" / "adapter_model.safetensors"))
    assert flt.keys() == adapter["whole"].keys()
    a, b = (torch.cat([d[k].flatten() for k in sorted(d) if "lora_B" in k]) for d in (adapter["whole"], flt))
    # B starts at 0, so B is what trained; only the kernels' 8-bit activations differ: 2.5% apart measured
    assert 0 < (a - b).norm() < 0.1 * b.norm()
    with pytest.raises(ValueError, match=r"base_dtype"):
        lora_over(None, tmp_path / "whole", resume=True, train_config=None, dtype="float32")
    with pytest.raises(ValueError, match=r"base dtype is one of auto, float32 .* got 'q8_0'"):
        lora_over(path, tmp_path / "q8", dtype="q8_0")


def test_a_lora_run_on_a_block_file_loads_back_over_its_float_base(tmp_path):
    """A LoRA run's base read again to load the run: a GGUF file of blocks, which the loader keeps in its blocks by
    default, comes back as float32 for the adapter to join (its blocks have no weight to add to)."""
    pytest.importorskip("gguf")
    pytest.importorskip("peft")
    from support.gguf_files import byte_level_bpe, hf_model, write_gguf

    from decoderlab.quant import is_block_layer

    bpe = byte_level_bpe(300, texts=[" ".join(m["content"] for c in CONVS for m in c) * 3])
    path = write_gguf(tmp_path / "base.gguf", "llama", hf_model("llama", bpe.get_vocab_size()), bpe, qtype="Q8_0")
    finetune(CONVS, out=tmp_path / "run", checkpoint=path, train_config=tiny_cfg(max_steps=1), val_fraction=0,
             eval_prompts=0, progress_bar=False, logger=False, accelerator="cpu",
             lora={"rank": 2, "alpha": 4, "dropout": 0.0, "targets": ["attn"]})
    model = load_model(tmp_path / "run").model
    assert not any(is_block_layer(m) for m in model.modules())


def test_a_lora_run_adding_chat_tokens_keeps_the_vocabulary_in_blocks_and_evaluates_the_model_as_it_trained(tmp_path):
    """A template whose tokens the file lacks (decoderlab's) grows the tied q8_0 embedding and output layer in their
    blocks (one set of bytes, read both ways: no float32 copy of the vocabulary); the run returns the model as it
    trained, adapters unmerged, and the end-of-run evaluation scores that model: the last validation's loss."""
    pytest.importorskip("gguf")
    pytest.importorskip("peft")
    from decoderlab.lora import has_lora
    from decoderlab.quant import is_block_layer

    model, tok, s = lora_over(block_file(tmp_path), tmp_path / "run", steps=2, template="decoderlab")
    assert s.added_tokens and model.config.num_tokens == tok.vocab_size == model.we.num_embeddings
    assert is_block_layer(model.we) and is_block_layer(model.fc_layer) and has_lora(model)
    assert model.fc_layer.packed[0] is model.we.packed[0]
    assert s.eval_on == "train" and s.val_history
    assert s.evaluation["loss"] == pytest.approx(s.val_history[-1][1], rel=1e-5)
