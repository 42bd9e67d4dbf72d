"""``ModelConfig``: everything needed to build a ``DecoderOnlyTransformer`` (saved as ``config.json`` in every
checkpoint), and ``preset(name)``, the config of a named preset (the presets themselves, as plain data, are
in :mod:`.presets`; re-exported here). No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .names import INITS, KERNELS, LAYER_TYPES, MLPS, NORMS, POSITIONS, ROPE_LAYOUTS
from .presets import PRESETS
from .settings import Settings


@dataclass
class ModelConfig(Settings):
    """Everything needed to build a ``DecoderOnlyTransformer``; saved as ``config.json`` in every checkpoint.

    Attributes:
        num_tokens: vocabulary size (number of token ids, logits per position).
        d_model: values per token (embedding size).
        n_layer: number of decoder blocks.
        n_head: attention (query) heads per block; d_model must be divisible by n_head unless ``head_dim`` is
            given.
        n_kv_head: key/value heads for grouped-query attention (Ainslie et al. 2023, "GQA"): each group of
            n_head / n_kv_head query heads shares one key and value head; 0 means n_head (plain multi-head),
            1 multi-query (Shazeer 2019). n_head must be a multiple of it. The KV cache holds n_kv_head heads.
            Resolved: :attr:`kv_heads`.
        head_dim: values per head (Hugging Face's ``head_dim``); 0 means d_model // n_head. Resolved:
            :attr:`d_head`. With another value the heads' width n_head * head_dim differs from d_model (Qwen3:
            d_model 1024, 16 heads of 128), which needs ``attn_out_proj``.
        max_len: context length in tokens.
        d_ff: hidden size of the MLP (0 means 4 * d_model when mlp is "gelu").
        dropout: dropout probability (embeddings, attention percents, residual branches).
        norm: "none" | "layernorm" | "rmsnorm" (pre-norm, plus a final norm before ``fc_layer``).
        position: "sinusoidal" | "learned" | "rope" | "none".
        mlp: "none" | "gelu" (GELU with the tanh approximation, as GPT-2) | "relu2" (ReLU squared,
            relu(x)^2, So et al. 2021 "Primer"; as in the modded-nanogpt speedrun) | "swiglu" (the gated
            MLP of Llama: down(silu(gate(x)) * up(x)), Shazeer 2020 "GLU Variants Improve Transformer"; d_ff is
            the gate's and up's width) | "geglu" (the same gate through GELU's tanh approximation,
            down(gelu(gate(x)) * up(x)): Gemma's).
        bias: biases in the attention projections, the MLP and the norms.
        tie_weights: ``fc_layer.weight`` is the word embedding matrix.
        attention: the attention kernel, "sdpa" | "explicit".
        attn_out_proj: apply an output projection after the heads (the lesson has none).
        lm_head_bias: a bias in ``fc_layer`` (the lesson's nn.Linear has one; GPT-2 has none).
        init: "default" (PyTorch's, as in the lesson) | "gpt2" (normal std 0.02, residual projections scaled
            by 1/sqrt(2 n_layer)).
        norm_eps: epsilon of the norms.
        qk_norm: RMS-normalise each head's queries and keys (no gain, eps ``norm_eps``) before rotary
            positions and the dot product (Henry et al. 2020 "Query-Key Normalization"; as in modded-nanogpt).
        rope_theta: the rotary base (rope only): pair i turns by pos * rope_theta^(-2i/d_head).
        rope_layout: which values rope pairs (rope only): "interleaved" (x[2i], x[2i+1]), RoFormer's and the
            default; "rotate_half" (x[i], x[i + d_head/2]), Hugging Face's Llama family.
        qkv_bias: biases on the query/key/value projection only (Qwen2); ``bias`` puts them everywhere.
        qk_norm_gain: with ``qk_norm``, a learned RMSNorm gain of size d_head for the queries and one for the
            keys, shared by the heads (Qwen3's q_norm / k_norm).
        zero_init: initialise the residual output projections (``attention.proj``, ``mlp.proj``) to zero, so
            every block starts as the identity (as in modded-nanogpt and nanochat).
        sliding_window: the positions a sliding layer sees (0: none): query i sees key j when 0 <= i - j <
            sliding_window (transformers' ``sliding_window``, llama.cpp's ``n_swa``: itself and the W - 1 before).
        layer_types: one of "full_attention" / "sliding_attention" per layer (transformers' ``layer_types``);
            empty means every layer slides when ``sliding_window`` is set (Mistral), else none. Gemma 3: five
            sliding layers to one full. Resolved: :meth:`window_of`.
        rope_local_theta: the rotary base of the sliding layers (rope only; 0: ``rope_theta``). Gemma 3: 10,000
            locally, 1,000,000 (``rope_theta``) on its full layers.
        sandwich_norm: a norm after attention and after the MLP too, before each is added to the residual
            stream (``norm_1_post``, ``norm_2_post``: Gemma 2/3's post_attention / post_feedforward norms),
            beside the usual pre-norms.
        embed_scale: the word embeddings multiplied by sqrt(d_model), rounded to their dtype first (Gemma's, as
            transformers rounds it).
        query_pre_attn_scalar: the attention scores are Q Kᵀ / sqrt(query_pre_attn_scalar) (Gemma's; 0:
            d_head, the usual 1 / sqrt(d_head)).

    Gemma's RMSNorm multiplies by (1 + weight): decoderlab holds that gain itself, 1 + weight, as llama.cpp's
    converter stores it, so one RMSNorm serves every family (:mod:`decoderlab.hf.gemma` adds and subtracts the 1).
    """

    num_tokens: int = 4
    d_model: int = 2
    n_layer: int = 1
    n_head: int = 1
    max_len: int = 6
    d_ff: int = 0
    dropout: float = 0.0
    norm: str = "none"
    position: str = "sinusoidal"
    mlp: str = "none"
    bias: bool = False
    tie_weights: bool = False
    attention: str = "explicit"
    attn_out_proj: bool = False
    lm_head_bias: bool = True
    init: str = "default"
    norm_eps: float = 1e-5
    qk_norm: bool = False
    zero_init: bool = False
    n_kv_head: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_layout: str = "interleaved"
    qkv_bias: bool = False
    qk_norm_gain: bool = False
    sliding_window: int = 0
    layer_types: tuple = ()
    rope_local_theta: float = 0.0
    sandwich_norm: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float = 0.0

    def __post_init__(self):
        if isinstance(self.layer_types, list):  # (as JSON holds it)
            self.layer_types = tuple(self.layer_types)
        self.validate()

    def validate(self) -> "ModelConfig":
        """Raise ``ValueError`` naming the offending field and what is allowed."""
        self._check_numbers()
        for name, allowed in (
            ("norm", NORMS),
            ("position", POSITIONS),
            ("mlp", MLPS),
            ("attention", KERNELS),
            ("init", INITS),
            ("rope_layout", ROPE_LAYOUTS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
        for name in ("bias", "tie_weights", "attn_out_proj", "lm_head_bias", "qk_norm", "zero_init", "qkv_bias",
                     "qk_norm_gain", "sandwich_norm", "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_heads()
        self._check_layers()
        if self.sandwich_norm and self.norm != "rmsnorm":
            raise ValueError(f"sandwich_norm=True puts an RMSNorm after attention and the MLP (Gemma's), which needs "
                             f"norm='rmsnorm', got norm={self.norm!r}; set norm='rmsnorm' or sandwich_norm=False")
        if self.qk_norm_gain and not self.qk_norm:
            raise ValueError("qk_norm_gain=True is the gain of the QK-norm, which needs qk_norm=True; "
                             "set qk_norm=True or qk_norm_gain=False")
        return self

    def _check_numbers(self) -> None:
        for name in ("num_tokens", "d_model", "n_layer", "n_head", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, zero in (("d_ff", "4 * d_model"), ("n_kv_head", "n_head"), ("head_dim", "d_model // n_head")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0 (0 means {zero}), got {value!r}")
        if isinstance(self.dropout, bool) or not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, zero in (("rope_local_theta", "rope_theta"), ("query_pre_attn_scalar", "d_head")):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0 (0 means {zero}), got {value!r}")
        value = self.sliding_window
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"sliding_window must be an integer >= 0 (0 means no window), got {value!r}")

    def _check_layers(self) -> None:
        """``layer_types``: empty, or one known type per layer; a sliding layer needs a window."""
        types = self.layer_types
        if not isinstance(types, tuple) or (types and (len(types) != self.n_layer
                                                       or any(t not in LAYER_TYPES for t in types))):
            raise ValueError(f"layer_types must be empty or one of {', '.join(LAYER_TYPES)} per layer (n_layer "
                             f"{self.n_layer}), got {types!r}")
        if "sliding_attention" in types and not self.sliding_window:
            raise ValueError("layer_types has 'sliding_attention' layers but sliding_window is 0 (no window); set "
                             "sliding_window to the positions they see")

    def _check_heads(self) -> None:
        """The head sizes: d_model splits into n_head heads (or head_dim is given), the key/value heads divide
        the query heads, and rope has an even head size."""
        if not self.head_dim and self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"allowed n_head for d_model {self.d_model}: "
                f"{', '.join(str(h) for h in range(1, self.d_model + 1) if self.d_model % h == 0)}"
            )
        if self.n_head % self.kv_heads != 0:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}); allowed n_kv_head: "
                f"0 (= n_head), {', '.join(str(k) for k in range(1, self.n_head + 1) if self.n_head % k == 0)}"
            )
        if not self.attn_out_proj and self.n_head * self.d_head != self.d_model:
            raise ValueError(
                f"without an output projection (attn_out_proj=False) the heads' width n_head * head_dim = "
                f"{self.n_head * self.d_head} must be d_model ({self.d_model}); set attn_out_proj=True or head_dim=0"
            )
        if self.position == "rope" and self.d_head % 2 != 0:
            raise ValueError(
                f"position 'rope' needs an even head size, but the head size is {self.d_head}; "
                f"choose n_head (or head_dim) so that it is even, or another position ({', '.join(POSITIONS)})"
            )

    @property
    def d_head(self) -> int:
        """Values per attention head: ``head_dim``, or d_model // n_head when it is 0."""
        return self.head_dim or self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_head``, or n_head when it is 0."""
        return self.n_kv_head or self.n_head

    def window_of(self, layer: int) -> int | None:
        """The positions layer ``layer`` sees (its sliding window), or None for full attention."""
        if not self.sliding_window:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def rope_theta_of(self, layer: int) -> float:
        """The rotary base of layer ``layer``: ``rope_local_theta`` for a sliding layer when set, else
        ``rope_theta``."""
        return self.rope_local_theta if self.rope_local_theta and self.window_of(layer) else self.rope_theta

    @property
    def attn_scale(self) -> float:
        """What the attention scores Q Kᵀ are multiplied by: 1 / sqrt(query_pre_attn_scalar or d_head)."""
        return (self.query_pre_attn_scalar or self.d_head) ** -0.5

    @property
    def ff_size(self) -> int:
        return self.d_ff or 4 * self.d_model

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


def preset(name: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a named preset, with optional field overrides (e.g. ``num_tokens=...``).

    Raises ``ValueError`` for an unknown name, listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
