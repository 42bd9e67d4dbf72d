"""``ModelConfig``: everything needed to build a ``DecoderOnlyTransformer`` (saved as ``config.json`` in every
checkpoint), and the named presets, as plain data (no torch).

Sources: the StatQuest lesson (the 37-parameter ``statquest`` preset); nanoGPT (``baby-shakespeare``,
``shakespeare-char``); Radford et al. 2019 (``gpt2``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .names import INITS, KERNELS, MLPS, NORMS, POSITIONS


@dataclass
class ModelConfig:
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict; unknown keys raise ``ValueError`` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------------------------------------
# Presets, by name, in one place
# ----------------------------------------------------------------------------------------------------------

_GPT = dict(norm="layernorm", position="learned", mlp="gelu", tie_weights=True, attention="sdpa",
            attn_out_proj=True, lm_head_bias=False, init="gpt2")

PRESETS: dict[str, dict[str, Any]] = {
    # The lesson: 1 layer, 1 head, no norm, no MLP, sinusoidal positions, no dropout, 37 parameters for the
    # 5-token vocabulary (what, is, statquest, awesome, <EOS>).
    "statquest": dict(num_tokens=5, d_model=2, n_layer=1, n_head=1, max_len=6, norm="none",
                      position="sinusoidal", mlp="none", bias=False, tie_weights=False, attention="explicit",
                      attn_out_proj=False, lm_head_bias=True, init="default", dropout=0.0),
    # The common CPU "baby GPT" on tinyshakespeare (char level: 65 characters).
    "baby-shakespeare": dict(_GPT, num_tokens=65, d_model=128, n_layer=4, n_head=4, max_len=64, bias=False,
                             dropout=0.0),
    # The speedrun's model: baby-shakespeare's size with rotary positions, QK-norm, ReLU² and
    # zero-initialised output projections (recipe "baby-shakespeare-speedrun" in decoderlab.training.recipes).
    "baby-shakespeare-speedrun": dict(_GPT, num_tokens=65, d_model=128, n_layer=4, n_head=4, max_len=64,
                                      bias=False, dropout=0.0, position="rope", mlp="relu2", qk_norm=True,
                                      zero_init=True),
    # nanoGPT's shakespeare_char configuration.
    "shakespeare-char": dict(_GPT, num_tokens=65, d_model=384, n_layer=6, n_head=6, max_len=256, bias=False,
                             dropout=0.2),
    # GPT-2 small, 124M.
    "gpt2": dict(_GPT, num_tokens=50257, d_model=768, n_layer=12, n_head=12, max_len=1024, bias=True,
                 dropout=0.0),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The ``ModelConfig`` of a named preset, with optional field overrides (e.g. ``num_tokens=...``).

    Raises ``ValueError`` for an unknown name, listing the known ones.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})
