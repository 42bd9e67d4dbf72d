"""Tiny random ``transformers`` models of the Llama family (Llama, Qwen2, Qwen3, Mistral), built here, and the tests'
own mapping of their weights onto decoderlab's names (INTERFACE.md's): the smallest that shows the forward is the
same. decoderlab's own Hugging Face conversion is its loader's; this one stays in the tests."""

import torch
import transformers

import decoderlab as dl

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=48, rms_norm_eps=1e-6, pad_token_id=None, bos_token_id=None, eos_token_id=None)

#: each accepted architecture, tiny: (config class, model class, its own fields)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=500.0),
                   tie_word_embeddings=False)),
    "llama-mqa-tied": ("LlamaConfig", "LlamaForCausalLM",
                       dict(num_key_value_heads=1, rope_parameters=dict(rope_type="default", rope_theta=100000.0),
                            tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, rope_parameters=dict(rope_type="default", rope_theta=1000.0),
                   tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_key_value_heads=2, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                   tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_key_value_heads=2, sliding_window=None,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0), tie_word_embeddings=False)),
}


def hf_model(name: str, seed: int = 0):
    """A random ``transformers`` model of ``ARCHITECTURES[name]``, its weights spread wider than the init's (norm
    gains around 1) so that every one moves the logits, in eval mode, float32."""
    config_cls, model_cls, own = ARCHITECTURES[name]
    config = getattr(transformers, config_cls)(**_COMMON, **own)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if key.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model


def our_config(hf_config, attention: str = "sdpa") -> dl.ModelConfig:
    """The ``ModelConfig`` of a Llama-family ``transformers`` config (this test's mapping)."""
    c = hf_config
    kind = type(c).__name__
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return dl.ModelConfig(
        num_tokens=c.vocab_size, d_model=c.hidden_size, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        n_kv_head=c.num_key_value_heads, head_dim=0 if head_dim * c.num_attention_heads == c.hidden_size else head_dim,
        max_len=c.max_position_embeddings, d_ff=c.intermediate_size, norm="rmsnorm", norm_eps=c.rms_norm_eps,
        position="rope", rope_layout="rotate_half", rope_theta=float(c.rope_parameters["rope_theta"]), mlp="swiglu",
        bias=False, qkv_bias=kind == "Qwen2Config", qk_norm=kind == "Qwen3Config", qk_norm_gain=kind == "Qwen3Config",
        tie_weights=bool(c.tie_word_embeddings), attention=attention, attn_out_proj=True, lm_head_bias=False,
    )


def our_state(hf_state: dict, n_layer: int) -> dict:
    """Our parameter names (INTERFACE.md's) for a Llama-family state dict: q/k/v concatenated into ``qkv``."""
    out = {"we.weight": hf_state["model.embed_tokens.weight"], "norm_f.weight": hf_state["model.norm.weight"],
           "fc_layer.weight": hf_state["lm_head.weight"]}
    for i in range(n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        for kind in ("weight", "bias"):
            if attn + f"q_proj.{kind}" in hf_state:
                out[ours + f"attention.qkv.{kind}"] = torch.cat([hf_state[attn + f"{p}_proj.{kind}"] for p in "qkv"])
        pairs = {"input_layernorm": "norm_1", "post_attention_layernorm": "norm_2", "self_attn.o_proj": "attention.proj",
                 "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
                 "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.fc", "mlp.down_proj": "mlp.proj"}
        for theirs, mine in pairs.items():
            if hf + theirs + ".weight" in hf_state:
                out[ours + mine + ".weight"] = hf_state[hf + theirs + ".weight"]
    return out


def ours_of(hf, attention: str = "sdpa") -> dl.DecoderOnlyTransformer:
    model = dl.DecoderOnlyTransformer(our_config(hf.config, attention))
    missing, unexpected = model.load_state_dict(our_state(hf.state_dict(), hf.config.num_hidden_layers), strict=True)
    assert not missing and not unexpected
    return model.eval()
