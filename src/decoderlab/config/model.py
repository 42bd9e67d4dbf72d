"""``ModelConfig``: everything needed to build a ``DecoderOnlyTransformer`` (saved as ``config.json`` in every
checkpoint), and ``preset(name)``, the config of a named preset (the presets themselves, as plain data, are
in :mod:`.presets`; re-exported here). No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .names import INITS, KERNELS, MLPS, NORMS, POSITIONS
from .presets import PRESETS
from .settings import Settings


@dataclass
class ModelConfig(Settings):
    """Everything needed to build a ``DecoderOnlyTransformer``; saved as ``config.json`` in every checkpoint.

    Attributes:
        num_tokens: vocabulary size (number of token ids, logits per position).
        d_model: values per token (embedding size).
        n_layer: number of decoder blocks.
        n_head: attention heads per block; d_model must be divisible by n_head.
        max_len: context length in tokens.
        d_ff: hidden size of the MLP (0 means 4 * d_model when mlp is "gelu").
        dropout: dropout probability (embeddings, attention percents, residual branches).
        norm: "none" | "layernorm" | "rmsnorm" (pre-norm, plus a final norm before ``fc_layer``).
        position: "sinusoidal" | "learned" | "rope" | "none".
        mlp: "none" | "gelu" (GELU with the tanh approximation, as GPT-2) | "relu2" (ReLU squared,
            relu(x)^2, So et al. 2021 "Primer"; as in the modded-nanogpt speedrun).
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
        zero_init: initialise the residual output projections (``attention.proj``, ``mlp.proj``) to zero, so
            every block starts as the identity (as in modded-nanogpt and nanochat).
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

    def __post_init__(self):
        self.validate()

    def validate(self) -> "ModelConfig":
        """Raise ``ValueError`` naming the offending field and what is allowed."""
        for name in ("num_tokens", "d_model", "n_layer", "n_head", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff < 0:
            raise ValueError(f"d_ff must be an integer >= 0 (0 means 4 * d_model), got {self.d_ff!r}")
        if isinstance(self.dropout, bool) or not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.norm_eps, bool) or not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        for name, allowed in (
            ("norm", NORMS),
            ("position", POSITIONS),
            ("mlp", MLPS),
            ("attention", KERNELS),
            ("init", INITS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}); "
                f"allowed n_head for d_model {self.d_model}: "
                f"{', '.join(str(h) for h in range(1, self.d_model + 1) if self.d_model % h == 0)}"
            )
        for name in ("bias", "tie_weights", "attn_out_proj", "lm_head_bias", "qk_norm", "zero_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.position == "rope" and (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"position 'rope' needs an even head size, but d_model/n_head = {self.d_model // self.n_head}; "
                f"choose n_head so that d_model / n_head is even, or another position ({', '.join(POSITIONS)})"
            )
        return self

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

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
