"""The named model presets as plain data (no dataclasses, no torch): ``ModelConfig`` fields by preset name.

``config.model.preset(name)`` builds the ``ModelConfig`` of one; the command line's ``--help`` reads the
shapes from here without building a class (``bench/startup.py``).

Sources: the StatQuest lesson (the 37-parameter ``statquest`` preset); nanoGPT (``baby-shakespeare``,
``shakespeare-char``); Radford et al. 2019 (``gpt2``); Allal et al. 2025, "SmolLM2" (``smollm2-135m``'s shape, its
config.json).
"""

from __future__ import annotations

#: the GPT-2 block design shared by every preset but the lesson's
_GPT = dict(norm="layernorm", position="learned", mlp="gelu", tie_weights=True, attention="sdpa",
            attn_out_proj=True, lm_head_bias=False, init="gpt2")

PRESETS: dict[str, dict] = {
    # The lesson: 1 layer, 1 head, no norm, no MLP, sinusoidal positions, no dropout, 37 parameters for the
    # 5-token vocabulary (what, is, statquest, awesome, <EOS>).
    "statquest": dict(num_tokens=5, d_model=2, n_layer=1, n_head=1, max_len=6, norm="none",
                      position="sinusoidal", mlp="none", bias=False, tie_weights=False, attention="explicit",
                      attn_out_proj=False, lm_head_bias=True, init="default", dropout=0.0),
    # The common CPU "baby GPT" on tinyshakespeare (char level: 65 characters).
    "baby-shakespeare": dict(_GPT, num_tokens=65, d_model=128, n_layer=4, n_head=4, max_len=64, bias=False,
                             dropout=0.0),
    # The speedrun's model: baby-shakespeare's size with rotary positions, QK-norm, ReLU² and
    # zero-initialised output projections (recipe "baby-shakespeare-speedrun" in decoderlab.config.recipes).
    "baby-shakespeare-speedrun": dict(_GPT, num_tokens=65, d_model=128, n_layer=4, n_head=4, max_len=64,
                                      bias=False, dropout=0.0, position="rope", mlp="relu2", qk_norm=True,
                                      zero_init=True),
    # nanoGPT's shakespeare_char configuration.
    "shakespeare-char": dict(_GPT, num_tokens=65, d_model=384, n_layer=6, n_head=6, max_len=256, bias=False,
                             dropout=0.2),
    # GPT-2 small, 124M.
    "gpt2": dict(_GPT, num_tokens=50257, d_model=768, n_layer=12, n_head=12, max_len=1024, bias=True,
                 dropout=0.0),
    # SmolLM2-135M's shape (Hugging Face's LlamaForCausalLM: grouped-query attention of 9 query and 3 key/value
    # heads of 64, SwiGLU, rotate-half rope of base 100000, RMSNorm, tied embeddings), 134,515,008 parameters. Its
    # checkpoint reads up to 8192 tokens; this preset's context is 2048 (a static KV cache is max_len long).
    "smollm2-135m": dict(num_tokens=49152, d_model=576, n_layer=30, n_head=9, n_kv_head=3, d_ff=1536, max_len=2048,
                         norm="rmsnorm", norm_eps=1e-5, position="rope", rope_layout="rotate_half",
                         rope_theta=100000.0, mlp="swiglu", bias=False, tie_weights=True, attention="sdpa",
                         attn_out_proj=True, lm_head_bias=False, init="gpt2", dropout=0.0),
}
