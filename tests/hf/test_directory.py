"""Hugging Face directories in (decoderlab.hf.directory): every accepted class loads through decoderlab.load with
transformers' logits (1e-5, float32), its 20 greedy tokens (cache and no cache) and its tokenizer's ids; float16 /
bfloat16 files and shards load; each bad input is one ``decoderlab: error:`` line naming the file, the field and
what is allowed.

Every model is a tiny random one of its class, saved here with transformers' own ``save_pretrained``.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import decoderlab as dl  # noqa: E402
from decoderlab.cli import main as cli_main  # noqa: E402
from decoderlab.hf import from_hf, load_hf_directory  # noqa: E402

from .families import CLASSES, hf_directory  # noqa: E402

TEXT = "To be, or not to be: 1234 东京 😀"


def prompt_ids(auto, text: str = TEXT) -> list[int]:
    return auto(text)["input_ids"]


def greedy_no_cache(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("name", CLASSES)
def test_every_class_loads_with_the_logits_greedy_tokens_and_ids_of_transformers(tmp_path, name):
    hf, auto = hf_directory(tmp_path, name)
    m = dl.load(tmp_path)
    ids = prompt_ids(auto)
    assert m.tokenizer.with_special_tokens(m.tokenizer.encode(TEXT, allow_special=True)) == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(x).logits
        ours = m.model(x)
    assert ref.abs().max() > 0.1 and (ours - ref).abs().max().item() < 1e-5, name
    hf.generation_config.eos_token_id = hf.generation_config.pad_token_id = None
    want = hf.generate(x, max_new_tokens=20, do_sample=False, min_new_tokens=20)[0, len(ids):].tolist()
    got = dl.generate(m.model, ids, 20, temperature=0)
    assert got == want == greedy_no_cache(m.model, ids, 20), name  # with the KV cache and without
    # the text itself reads as transformers' tokenizer(text): Llama's start token first, nothing for Qwen, GPT-2
    assert dl.generate(m.model, TEXT, 20, temperature=0, tokenizer=m.tokenizer, stop_at_eos=False) == want, name
    assert m.model.config.num_tokens == len(auto) + 5 == m.tokenizer.vocab_size  # the spare rows padded


def test_a_llama_3_chat_template_writes_the_one_start_token(tmp_path):
    """Llama 3's template writes <|begin_of_text|> itself ({{ bos_token }}): the rendered chat holds exactly one,
    the ids of transformers' apply_chat_template, while a plain text gets it from the tokenizer (its
    post-processor), as transformers' tokenizer(text)."""
    from hf_chat_templates import LLAMA3

    from decoderlab.generation.engine import check_prompt

    from .families import chat_directory

    _, auto = chat_directory(tmp_path, "arcee", LLAMA3, ["<|start_header_id|>", "<|end_header_id|>"])
    m = dl.load(tmp_path)
    bos = m.tokenizer.bos_id
    assert bos == auto.bos_token_id == auto.convert_tokens_to_ids("<|begin_of_text|>") and m.tokenizer.add_bos_token
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    for more in (True, False):
        ids, _ = m.template.render(messages, m.tokenizer, add_generation_prompt=more)
        assert ids == auto.apply_chat_template(messages, add_generation_prompt=more)["input_ids"]
        assert ids.count(bos) == 1 and ids[0] == bos
    assert check_prompt(m.model, TEXT, m.tokenizer) == prompt_ids(auto) and prompt_ids(auto).count(bos) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_load_as_their_values(tmp_path, dtype):
    hf, auto = hf_directory(tmp_path / "f32", "qwen3")
    hf.to(dtype).save_pretrained(tmp_path / "half")
    auto.save_pretrained(tmp_path / "half")
    assert json.loads((tmp_path / "half" / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
    x = torch.tensor([prompt_ids(auto)])
    with torch.no_grad():
        # the half values computed in float32 (not hf.float(): its rope frequencies went through half too)
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "half", dtype=torch.float32)(x).logits
        model, _ = load_hf_directory(tmp_path / "half")
        assert model.we.weight.dtype == torch.float32 and (model(x) - ref).abs().max().item() < 1e-5
        half, _ = load_hf_directory(tmp_path / "half", dtype=dtype)
        assert half.we.weight.dtype == dtype and (half(x).float() - ref).abs().max().item() < 0.1


def test_a_sharded_directory_loads(tmp_path):
    hf, auto = hf_directory(tmp_path / "one", "llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    auto.save_pretrained(tmp_path / "sharded")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    x = torch.tensor([prompt_ids(auto)])
    with torch.no_grad():
        assert torch.equal(dl.load(tmp_path / "sharded").model(x), dl.load(tmp_path / "one").model(x))


def test_from_hf_reads_a_model_in_memory_and_its_state_dict(tmp_path):
    hf, auto = hf_directory(tmp_path, "qwen2")
    x = torch.tensor([prompt_ids(auto)])
    with torch.no_grad():
        ref = hf(x).logits
        for model in (from_hf(hf), from_hf(hf.state_dict(), config=hf.config), from_hf(hf.model.state_dict(),
                                                                                        config=hf.config.to_dict())):
            assert (model(x) - ref).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------------
# config.json read as transformers reads it: which key wins, which layers slide
# ---------------------------------------------------------------------------------------------------------


def edited_logits(tmp_path, name: str, delete=(), **fields):
    """(transformers' logits, ours) of a tiny ``name`` directory whose config.json was edited after saving
    (``fields`` set, ``delete`` removed), and the transformers model as loaded from it."""
    _, auto = hf_directory(tmp_path, name)
    edit_config(tmp_path, **fields)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in delete}))
    x = torch.tensor([prompt_ids(auto)])
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        return ref(x).logits, dl.load(tmp_path).model(x), ref


@pytest.mark.parametrize("scaling,theta", [
    ({"rope_type": "default", "rope_theta": 20000.0}, 20000.0),  # its own base, not rope_parameters'
    ({"type": "default"}, 10000.0),  # none of its own: the class's default, never the base of the block it replaced
    ({"type": "default"}, 777.0),  # ... or config.json's top-level rope_theta
])
def test_rope_scaling_is_read_over_rope_parameters_as_transformers_does(tmp_path, scaling, theta):
    """transformers 5 reads ``rope_scaling or rope_parameters``: the legacy key, when it holds anything, replaces
    the whole block (a YaRN one is refused by name: test_a_config_field_the_class_cannot_honour)."""
    plain = {"rope_type": "default", "rope_theta": 10.0}
    top = {"rope_theta": theta} if theta == 777.0 else {}
    ref, ours, hf = edited_logits(tmp_path, "llama", rope_parameters=plain, rope_scaling=scaling, **top)
    assert hf.config.rope_parameters["rope_theta"] == theta
    without, _, _ = edited_logits(tmp_path / "plain", "llama", rope_parameters=plain)
    assert (without - ref).abs().max() > 1e-3  # the base matters in these logits (100 times the tolerance)
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("saved_layer_types", [True, False])  # as transformers 5 writes it, and as Qwen2's own hub
def test_a_sliding_window_on_no_layer_loads_with_transformers_logits(tmp_path, saved_layer_types):  # configs (none)
    """use_sliding_window with max_window_layers covering every layer (Qwen2.5's own configs: 28 of 28 or more):
    transformers slides none, so the window does not matter -- however short."""
    ref, ours, hf = edited_logits(tmp_path, "qwen2", delete=() if saved_layer_types else ("layer_types",),
                                  use_sliding_window=True, sliding_window=4, max_window_layers=2,
                                  layer_types=["full_attention"] * 2)
    assert hf.config.layer_types == ["full_attention"] * 2 and hf.config.sliding_window == 4
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("saved_layer_types", [True, False])
def test_a_layer_that_slides_attends_through_its_window_as_transformers_does(tmp_path, saved_layer_types):
    """Layer 1 of 2 slides over 4 positions, from layer_types or from max_window_layers: transformers' logits on
    a prompt longer than the window (they differ without it: test_the_window_matters)."""
    ref, ours, hf = edited_logits(tmp_path, "qwen2", delete=() if saved_layer_types else ("layer_types",),
                                  use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                  layer_types=["full_attention", "sliding_attention"])
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    model = dl.load(tmp_path).model
    assert model.config.layer_types == ("full_attention", "sliding_attention") and model.config.sliding_window == 4
    assert (ours - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["mistral-window", "qwen2-window", "gemma3"])
def test_the_window_matters(tmp_path, name):
    """The tiny windowed classes' prompts are longer than their windows: the same model seeing every position
    gives other logits (so the parity tests above would fail without the window)."""
    hf, auto = hf_directory(tmp_path, name)
    model = dl.load(tmp_path).model
    x = torch.tensor([prompt_ids(auto)])
    assert x.size(1) > model.config.sliding_window
    with torch.no_grad():
        ref = hf(x).logits
        for block in model.blocks:
            block.attention.sliding_window = None
        assert (model(x) - ref).abs().max() > 1e-3


def test_a_gemma_directory_goes_back_out_with_its_logits_and_its_tokenizer(tmp_path):
    """Gemma 3 in and out: the written directory is Gemma3ForCausalLM again, with the first one's logits and its
    SentencePiece tokenizer's ids on 200 strings (norm weights stored minus 1 both ways)."""
    from decoderlab.export import to_hf

    from .families import strings

    hf, auto = hf_directory(tmp_path / "in", "gemma3")
    m = dl.load(tmp_path / "in")
    assert to_hf(m.model, m.tokenizer, tmp_path / "out")["architecture"] == "Gemma3ForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    auto_back = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    x = torch.tensor([prompt_ids(auto)])
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max().item() < 1e-5
    for name, p in hf.named_parameters():  # the stored weights themselves, the 1 of each gain subtracted again
        torch.testing.assert_close(back.get_parameter(name), p, rtol=0, atol=1e-7)
    texts = strings(["<start_of_turn>", "<end_of_turn>", "<bos>"])
    assert [auto_back(t)["input_ids"] for t in texts] == [auto(t)["input_ids"] for t in texts]


def test_a_window_as_long_as_the_context_loads(tmp_path):
    """A layer that slides over max_position_embeddings positions sees every position of every sequence decoderlab
    runs: no window, so no refusal, and transformers' logits."""
    ref, ours, _ = edited_logits(tmp_path, "mistral", sliding_window=64)
    assert (ours - ref).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------------------
# Bad input: each one line naming the file, the field and what is allowed
# ---------------------------------------------------------------------------------------------------------


def one_error_line(directory, capsys) -> str:
    capsys.readouterr()  # (save_pretrained's progress bars)
    assert cli_main(["generate", "--checkpoint", str(directory), "--max-new-tokens", "2", "To be"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("decoderlab: error: ")
    return captured.err


def edit_config(directory, **fields):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def test_an_architecture_not_accepted(tmp_path, capsys):
    tok = CLASSES["gpt2"][3]()
    config = transformers.GPTNeoXConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=32)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    err = one_error_line(tmp_path, capsys)
    assert (f"{tmp_path / 'config.json'}: architectures ['GPTNeoXForCausalLM'] is not a class decoderlab reads; "
            "allowed: GPT2LMHeadModel, Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
            "ApertusForCausalLM, ArceeForCausalLM, Gemma3ForCausalLM") in err


@pytest.mark.parametrize("name,fields,words", [
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
     "rope_parameters of rope_type 'llama3' is not implemented; allowed: rope_type 'default'"),
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0}, rope_parameters=None),
     "rope_scaling of rope_type 'yarn' is not implemented; allowed: rope_type 'default'"),
    # YaRN added under the legacy key beside a plain rope_parameters (Qwen2.5's long-context recipe): transformers
    # takes rope_scaling, so it is refused, not ignored
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
     "rope_scaling of rope_type 'yarn' (read over rope_parameters, as transformers does) is not implemented; "
     "allowed: rope_type 'default'"),
    ("mistral", dict(sliding_window=0), "sliding_window is 0; allowed: null or a positive integer"),
    ("qwen2", dict(use_sliding_window=True, layer_types=["full_attention", "chunked_attention"]),
     "layer_types ['full_attention', 'chunked_attention'] is not one type per layer; allowed: a list of "
     "num_hidden_layers 2 of 'full_attention', 'sliding_attention'"),
    ("qwen2", dict(use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
     "layer_types makes layer 0 'sliding_attention', but use_sliding_window is false, which gives them no window"),
    ("mistral", dict(attention_bias=True),
     "attention_bias=True, but MistralForCausalLM has no biases (transformers would leave them out); allowed: "
     "attention_bias false or absent"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu' is not implemented for LlamaForCausalLM; allowed: 'silu'"),
    ("apertus", dict(hidden_act="xielu"), "hidden_act 'xielu' is not implemented; allowed: 'relu2'"),
    # a Gemma variant decoderlab does not compute, named by its field
    ("gemma3", dict(final_logit_softcapping=30.0), "final_logit_softcapping is 30.0; soft-capped logits are not "
     "implemented; allowed: null"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping is 50.0; soft-capped logits"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention is true"),
    ("gemma3", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not implemented; allowed: "
     "'gelu_pytorch_tanh'"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.full_attention of rope_type 'linear' is not implemented; allowed: rope_type 'default'"),
    ("gemma3", dict(architectures=["Gemma3ForConditionalGeneration"], vision_config={"model_type": "siglip"}),
     "Gemma3ForConditionalGeneration (vision_config {'model_type': 'siglip'}): Gemma 3's vision tower (SigLIP)"),
    ("gemma3", dict(architectures=["Gemma3nForCausalLM"], model_type="gemma3n_text"),
     "Gemma3nForCausalLM (model_type 'gemma3n_text'): Gemma 3n's per-layer embeddings"),
])
def test_a_config_field_the_class_cannot_honour(tmp_path, capsys, name, fields, words):
    hf_directory(tmp_path, name)
    edit_config(tmp_path, **fields)
    err = one_error_line(tmp_path, capsys)
    assert f"{tmp_path / 'config.json'}: " in err and words in err, err


def test_a_missing_or_inconsistent_shard(tmp_path, capsys):
    hf, auto = hf_directory(tmp_path / "x", "llama")
    hf.save_pretrained(tmp_path / "missing", max_shard_size="100KB")
    auto.save_pretrained(tmp_path / "missing")
    index = json.loads((tmp_path / "missing" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "missing" / shard).unlink()
    err = one_error_line(tmp_path / "missing", capsys)
    assert f"model.safetensors.index.json: shard {shard} (holding " in err and ") is missing" in err

    hf.save_pretrained(tmp_path / "moved", max_shard_size="100KB")
    auto.save_pretrained(tmp_path / "moved")
    path = tmp_path / "moved" / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    names = sorted(index["weight_map"])
    shards = sorted(set(index["weight_map"].values()))
    moved = next(n for n in names if index["weight_map"][n] == shards[0])
    index["weight_map"][moved] = shards[1]  # the index says it is in another shard
    path.write_text(json.dumps(index))
    err = one_error_line(tmp_path / "moved", capsys)
    assert f"{tmp_path / 'moved' / shards[0]}: inconsistent shard: it holds ['{moved}'" in err or (
        f"{tmp_path / 'moved' / shards[1]}: inconsistent shard: it lacks ['{moved}']" in err), err


def test_weights_whose_shape_disagrees_with_config_json(tmp_path, capsys):
    hf_directory(tmp_path, "qwen2")
    edit_config(tmp_path, intermediate_size=80)
    err = one_error_line(tmp_path, capsys)
    assert f"{tmp_path / 'model.safetensors'}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape (96, 64), but " \
           f"{tmp_path / 'config.json'} gives it (80, 64); allowed: the shapes config.json's sizes make" in err


def test_a_tokenizer_larger_than_the_embedding(tmp_path, capsys):
    _, auto = hf_directory(tmp_path, "llama", spare_rows=0)
    edit_config(tmp_path, vocab_size=len(auto) - 1)
    err = one_error_line(tmp_path, capsys)
    assert (f"{tmp_path / 'tokenizer.json'}: the tokenizer has {len(auto)} tokens, more than the model's embedding "
            f"has rows (vocab_size {len(auto) - 1} in config.json); allowed: at most {len(auto) - 1} tokens") in err


def test_a_damaged_weight_file_and_a_weight_of_another_dtype(tmp_path, capsys):
    hf, _ = hf_directory(tmp_path, "arcee")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = one_error_line(tmp_path, capsys)
    assert "model.safetensors: tensor" in err and "(a truncated or damaged file)" in err
    hf.to(torch.float64).save_pretrained(tmp_path)
    err = one_error_line(tmp_path, capsys)
    assert "model.safetensors: tensor 'lm_head.weight' has dtype F64; allowed: F32, BF16, F16" in err


@pytest.mark.parametrize("name", ["llama", "qwen3", "apertus", "gemma3"])
def test_commands_take_the_directory_as_their_checkpoint(tmp_path, capsys, name):
    """generate, verify (the float64 reference of the whole pass) and explain read it as any checkpoint."""
    hf_directory(tmp_path, name)
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(tmp_path), "--max-new-tokens", "5", "--seed", "0", "To be"]) == 0
    assert cli_main(["verify", "--checkpoint", str(tmp_path), "To be, or not"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("all ok")
    assert cli_main(["explain", "--checkpoint", str(tmp_path), "To be, or not"]) == 0
    assert "=> the top next token after" in capsys.readouterr().out
