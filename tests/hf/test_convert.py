"""Every model decoderlab can build out (decoderlab.hf.convert's tables the other way): each design a class computes
is written with that class, and ``AutoModelForCausalLM.from_pretrained`` gives its logits (1e-5, float32) --
GPT-2, Llama (+ GQA, biases), Qwen2 (q/k/v biases), Qwen3 (QK-norm, with and without a gain), Apertus for the
default recipe's model (interleaved rope, LayerNorm without a bias, QK-norm, ReLU²) and Arcee; the tokenizer is
always written (AutoTokenizer's ids are ours), the chat template as Jinja (apply_chat_template gives our ids),
LoRA merged first; a model no class computes is refused, naming the fields and the nearest class, and nothing is
written. The two exact rewrites behind the recipe's export are checked in float64 on their own.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import decoderlab as dl  # noqa: E402
from decoderlab.export import to_hf  # noqa: E402
from decoderlab.hf import ExportError, export_family  # noqa: E402
from decoderlab.hf.convert import center_writes, head_order  # noqa: E402
from decoderlab.tokenizers import BPETokenizer, CharTokenizer  # noqa: E402

from .families import CORPUS  # noqa: E402

TEXT = "To be, or not to be, that is the question"
_SMALL = dict(d_model=64, n_layer=2, n_head=4, max_len=48)
#: (name, the preset and fields, the class it goes to)
DESIGNS = [
    ("gpt2", dict(preset="gpt2"), "GPT2LMHeadModel"),
    ("gpt2-relu2-untied-no-bias", dict(preset="baby-shakespeare", mlp="relu2", tie_weights=False), "GPT2LMHeadModel"),
    ("llama-gqa", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                       rope_theta=5000.0, tie_weights=False), "LlamaForCausalLM"),
    ("llama-mqa-bias-rotate-half", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu",
                                        n_kv_head=1, bias=True, rope_layout="rotate_half"), "LlamaForCausalLM"),
    ("qkv-bias-own-bpe", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                              qkv_bias=True), "LlamaForCausalLM"),  # not Qwen2: AutoTokenizer would rebuild the BPE
    ("qwen3", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                   qk_norm=True, qk_norm_gain=True, head_dim=24), "Qwen3ForCausalLM"),
    ("qwen3-no-gain-layernorm", dict(preset="baby-shakespeare", position="rope", mlp="swiglu", qk_norm=True),
     "Qwen3ForCausalLM"),
    ("default-recipe", dict(preset="baby-shakespeare-speedrun"), "ApertusForCausalLM"),
    ("recipe-rmsnorm-gqa-gain", dict(preset="baby-shakespeare-speedrun", norm="rmsnorm", n_kv_head=2,
                                     qk_norm_gain=True), "ApertusForCausalLM"),
    ("arcee-gelu", dict(preset="baby-shakespeare", position="rope"), "ArceeForCausalLM"),
    # sliding windows shorter than the text: every layer's (Mistral), some layers' (Qwen3's layer_types)
    ("mistral-window", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                            sliding_window=5), "MistralForCausalLM"),
    ("qwen3-window", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True,
                          sliding_window=5, layer_types=("full_attention", "sliding_attention")), "Qwen3ForCausalLM"),
    # Gemma 3's options: a sliding layer with its own rope base, sandwich norms, GeGLU, a scaled embedding, MQA with
    # heads of 24, query_pre_attn_scalar, a QK-norm without a gain (written as Gemma's 0 = a gain of 1)
    ("gemma3", dict(preset="baby-shakespeare", position="rope", norm="rmsnorm", mlp="geglu", sandwich_norm=True,
                    embed_scale=True, qk_norm=True, n_kv_head=1, head_dim=24, query_pre_attn_scalar=10.0,
                    sliding_window=4, layer_types=("sliding_attention", "full_attention"), rope_local_theta=100.0),
     "Gemma3ForCausalLM"),
]


@pytest.fixture(scope="module")
def tokenizers():
    return {"char": CharTokenizer.from_text("\n".join(CORPUS)), "bpe": BPETokenizer.train(CORPUS, 350)}


def random_model(tokenizer, preset: str, seed: int = 0, **fields):
    """A model of ``preset`` + ``fields`` with every parameter moved off its initial value (zero-initialised
    projections, unit gains, zero biases all made to matter)."""
    torch.manual_seed(seed)
    model = dl.DecoderOnlyTransformer(dl.preset(preset, **_SMALL, num_tokens=tokenizer.vocab_size, **fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name,design,architecture", DESIGNS, ids=[d[0] for d in DESIGNS])
def test_every_exportable_design_loads_in_transformers_with_our_logits(tmp_path, tokenizers, name, design,
                                                                       architecture):
    tok = tokenizers["char" if "recipe" in name or "gpt2-relu2" in name else "bpe"]
    model = random_model(tok, **design)
    summary = to_hf(model, tok, tmp_path)
    assert summary["architecture"] == architecture == export_family(model.config, tok)[1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(hf).__name__ == architecture and len(auto) == tok.vocab_size
    ids = tok.encode(TEXT)
    assert auto(TEXT)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
        assert ours.abs().max() > 0.5 and (theirs - ours).abs().max().item() < 1e-5, name
        back = dl.load(tmp_path)
        assert (back.model(x) - ours).abs().max().item() < 1e-5 and back.tokenizer.encode(TEXT) == ids


def test_the_chat_template_is_written_as_jinja_and_lora_is_merged_first(tmp_path, tokenizers):
    from decoderlab.chat import add_chat_tokens, get_template
    from decoderlab.lora import apply_lora

    template = get_template("decoderlab")
    model, tok, _ = add_chat_tokens(random_model(tokenizers["bpe"], "baby-shakespeare-speedrun"), tokenizers["bpe"],
                                    template)
    lora = apply_lora(model.eval(), rank=4)
    with torch.no_grad():  # B starts at zero: give the adapters something to merge
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    x = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        want = lora(x)
    assert to_hf(lora, tok, tmp_path, template)["chat_template"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (hf(x).logits - want).abs().max().item() < 1e-5
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "or not"}]
    ids, _ = template.render(messages, tok)
    assert auto.apply_chat_template(messages, return_dict=False) == ids
    assert dl.load(tmp_path).template is not None  # and decoderlab reads it back


@pytest.mark.parametrize("fields,words", [
    (dict(preset="statquest"), "position='sinusoidal'"),
    (dict(preset="baby-shakespeare", qk_norm=True), "qk_norm=True (GPT-2 has no query/key norm)"),
    (dict(preset="baby-shakespeare", position="rope", bias=True), "position='rope'"),
    (dict(preset="baby-shakespeare", mlp="swiglu"), "mlp='swiglu'"),
])
def test_a_model_no_class_computes_is_refused_naming_the_fields_and_nothing_is_written(tmp_path, tokenizers, fields,
                                                                                        words):
    tok = tokenizers["char"]
    preset = fields.pop("preset")
    shape = dict(_SMALL) if preset != "statquest" else dict(d_model=2, max_len=6)
    model = dl.DecoderOnlyTransformer(dl.preset(preset, **shape, num_tokens=tok.vocab_size, **fields))
    with pytest.raises(ValueError, match="no Hugging Face class computes this model") as e:
        to_hf(model, tok, tmp_path / "out")
    assert words in str(e.value) and "the nearest is" in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_a_bias_the_class_lacks_is_refused_at_write_time_and_nothing_is_written(tmp_path, tokenizers):
    tok = tokenizers["bpe"]
    model = random_model(tok, "baby-shakespeare", position="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True,
                         bias=True)  # Qwen3 has q/k/v/o biases, not the MLP's
    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.gate\.bias is not zero, and the Hugging Face class has no "
                                         "such tensor"):
        to_hf(model, tok, tmp_path / "out")
    assert not list(tmp_path.iterdir())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("blocks.") and ".mlp." in n and n.endswith("bias"):
                p.zero_()
    assert to_hf(model, tok, tmp_path / "out")["architecture"] == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="tokenizer vocabulary size"):
        to_hf(model, tokenizers["char"], tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_a_qwen2_model_with_qwen_s_tokenizer_goes_back_to_qwen2(tmp_path):
    from .families import hf_directory

    hf, auto = hf_directory(tmp_path / "in", "qwen2")
    m = dl.load(tmp_path / "in")
    assert export_family(m.config)[1] == "Qwen2ForCausalLM" == m.to_hf(tmp_path / "out")["architecture"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = auto(TEXT)["input_ids"]
    assert again(TEXT)["input_ids"] == ids and type(again).__name__ == "Qwen2Tokenizer"
    with torch.no_grad():
        assert (back(torch.tensor([ids])).logits - hf(torch.tensor([ids])).logits).abs().max().item() < 1e-5


def test_export_family_names_the_class_of_each_design():
    assert export_family(dl.preset("gpt2"))[1] == "GPT2LMHeadModel"
    assert export_family(dl.preset("baby-shakespeare-speedrun"))[1] == "ApertusForCausalLM"
    with pytest.raises(ExportError) as e:
        export_family(dl.preset("statquest"))
    assert e.value.field == "position"


# ---------------------------------------------------------------------------------------------------------
# The two rewrites, in float64
# ---------------------------------------------------------------------------------------------------------


def test_centred_writes_make_layernorm_rmsnorm():
    """After center_writes the residual stream is mean-free, so LayerNorm (no bias) equals RMSNorm with its gain."""
    torch.manual_seed(0)
    cfg = dl.preset("baby-shakespeare-speedrun", n_layer=2)
    model = dl.DecoderOnlyTransformer(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    new_cfg, state = center_writes(cfg, model.state_dict())
    assert (new_cfg.norm, new_cfg.tie_weights) == ("rmsnorm", False)
    rms = dl.DecoderOnlyTransformer(new_cfg).double().eval()
    rms.load_state_dict(state)
    ids = torch.randint(0, cfg.num_tokens, (2, 64))
    with torch.no_grad():
        assert (rms(ids) - model(ids)).abs().max().item() < 1e-12
        assert rms.we(ids).mean(-1).abs().max().item() < 1e-15  # every write is mean-free


def test_the_head_row_order_turns_interleaved_rope_into_rotate_half():
    torch.manual_seed(0)
    base = dl.preset("baby-shakespeare-speedrun", n_layer=1, qk_norm=False)
    model = dl.DecoderOnlyTransformer(base).double().eval()
    halves = dl.DecoderOnlyTransformer(base.replace(rope_layout="rotate_half")).double().eval()
    state = model.state_dict()
    order, d, q_rows = head_order(base), base.d_head, base.n_head * base.d_head
    assert order.tolist()[:4] == [0, 2, 4, 6] and order.tolist()[d // 2:d // 2 + 2] == [1, 3]
    qkv = state["blocks.0.attention.qkv.weight"].clone()
    qk = qkv[:2 * q_rows].reshape(-1, d, qkv.shape[1])[:, order].reshape(2 * q_rows, -1)
    halves.load_state_dict({**state, "blocks.0.attention.qkv.weight": torch.cat([qk, qkv[2 * q_rows:]])})
    ids = torch.randint(0, base.num_tokens, (2, 64))
    with torch.no_grad():
        assert (halves(ids) - model(ids)).abs().max().item() < 1e-12
    assert head_order(base.replace(rope_layout="rotate_half")) is None


def test_the_written_config_names_plain_rope_and_the_tokenizer_s_ids(tmp_path, tokenizers):
    tok = tokenizers["char"]
    to_hf(random_model(tok, "baby-shakespeare-speedrun"), tok, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}  # not Apertus's llama3
    assert (config["hidden_act"], config["tie_word_embeddings"], config["eos_token_id"]) == ("relu2", False, tok.eos_id)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
