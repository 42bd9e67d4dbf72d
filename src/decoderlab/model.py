"""The decoder-only transformer: ``ModelConfig``, named presets, ``DecoderBlock`` and ``DecoderOnlyTransformer``.

One class spans the StatQuest lesson's 37-parameter model (d_model 2, one head, no norm, no MLP) and GPT-2
small (124,439,808 parameters). Data flow, read top to bottom in ``DecoderOnlyTransformer.forward``:

    token ids (B, T) -> word embedding ``we`` (B, T, d_model) -> + positions ``pe``
    -> n_layer x DecoderBlock:  x = x + attention(norm_1(x));  x = x + mlp(norm_2(x))
    -> final norm ``norm_f`` -> fully connected layer ``fc_layer`` -> logits (B, T, num_tokens)

Sources: the StatQuest lesson (decoder-only transformer in PyTorch + Lightning); Radford et al. 2019 (GPT-2,
pre-LayerNorm blocks, initialisation scaled by 1/sqrt(2 n_layer)).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import KERNELS, MultiHeadAttention
from .positions import POSITIONS, LearnedPositionEncoding, PositionEncoding, RotaryEmbedding

NORMS = ("none", "layernorm", "rmsnorm")
MLPS = ("none", "gelu", "relu2")
INITS = ("default", "gpt2")


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
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
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
        for name in ("qk_norm", "zero_init"):
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
    # The speedrun's model (issue 12): baby-shakespeare's size with rotary positions, QK-norm, ReLU² and
    # zero-initialised output projections (recipe "baby-shakespeare-speedrun" in decoderlab.recipes).
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


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight. Shape (..., d)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm the config asks for, over the last dimension (d_model): LayerNorm (Ba et al. 2016), RMSNorm,
    or an identity for norm='none' (the lesson)."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.Identity()


class MLP(nn.Module):
    """The fully connected sublayer: Linear(d_model, d_ff) -> GELU (tanh approximation), or relu(x)^2 for
    mlp="relu2" -> Linear -> dropout. Shapes: (..., d_model) -> (..., d_model)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff_size, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ff_size, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.mlp == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return self.dropout(self.proj(h))


class DecoderBlock(nn.Module):
    """One decoder block: x = x + attention(norm_1(x)); x = x + mlp(norm_2(x)) (pre-norm; no MLP if mlp='none').

    With norm='none' and mlp='none' this is the lesson's "masked self-attention -> residual connection".
    Shapes: (B, T, d_model) -> (B, T, d_model). Setting ``self.record = {}`` stores the block's
    intermediates on the next forward pass: ``input``, ``normed`` (norm_1(x)), ``attn_out``, ``resid_1``,
    ``normed_2``, ``mlp_out``, ``resid_2`` (all (B, T, d_model)).
    """

    def __init__(self, cfg: ModelConfig, rope: nn.Module | None = None):
        super().__init__()
        self.norm_1 = make_norm(cfg)
        self.attention = MultiHeadAttention(
            cfg.d_model, cfg.n_head, bias=cfg.bias, dropout=cfg.dropout, kernel=cfg.attention,
            out_proj=cfg.attn_out_proj, rope=rope, qk_norm=cfg.qk_norm, qk_norm_eps=cfg.norm_eps,
        )
        self.has_mlp = cfg.mlp != "none"
        if self.has_mlp:
            self.norm_2 = make_norm(cfg)
            self.mlp = MLP(cfg)
        self.record: dict | None = None

    def forward(self, x, *, padding_mask=None, positions=None, cache=None):
        h = self.norm_1(x)
        a = self.attention(h, padding_mask=padding_mask, positions=positions, cache=cache)
        r1 = x + a
        out = r1
        if self.has_mlp:
            h2 = self.norm_2(r1)
            m = self.mlp(h2)
            out = r1 + m
        if self.record is not None:
            self.record.update(input=x, normed=h, attn_out=a, resid_1=r1)
            if self.has_mlp:
                self.record.update(normed_2=h2, mlp_out=m, resid_2=out)
        return out


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------


class DecoderOnlyTransformer(L.LightningModule):
    """A decoder-only (GPT-style) transformer; a ``lightning.LightningModule`` as in the lesson.

    Build it from a config or a preset, or with the lesson's arguments::

        DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)   # the lesson (statquest preset)
        DecoderOnlyTransformer(preset("baby-shakespeare"))
        DecoderOnlyTransformer("gpt2")

    ``forward(token_ids)``: (T,) -> logits (T, num_tokens) as in the lesson, or (B, T) -> (B, T, num_tokens).
    Optional keywords: ``padding_mask`` (B, T_k) bool, True = padded key; ``positions`` (T,) or (B, T); and
    ``cache`` (a ``generation.KVCache``) for decoding.

    Training (Lightning): ``training_step(batch, batch_idx)`` takes ``(inputs, labels)``, each (B, T) or (T,),
    labels of -100 are ignored; the loss is ``nn.CrossEntropyLoss``. ``configure_optimizers`` returns
    Adam(lr=0.1) as in the lesson, unless ``self.train_config`` (set by ``decoderlab.training``) asks for
    AdamW with a schedule.

    Raises:
        ValueError: token ids outside [0, num_tokens), a sequence longer than max_len, a bad shape.
    """

    def __init__(self, config: ModelConfig | str | None = None, *, num_tokens: int | None = None,
                 d_model: int | None = None, max_len: int | None = None, lr: float = 0.1, **overrides):
        super().__init__()
        lesson = {k: v for k, v in dict(num_tokens=num_tokens, d_model=d_model, max_len=max_len).items()
                  if v is not None}
        overrides = {**lesson, **overrides}
        if config is None:
            config = preset("statquest", **{"num_tokens": 4, **overrides})
        elif isinstance(config, str):
            config = preset(config, **overrides)
        elif isinstance(config, dict):
            config = ModelConfig.from_dict({**config, **overrides})
        elif not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, a preset name or a dict, got {type(config).__name__}")
        elif overrides:
            config = config.replace(**overrides)
        config.validate()
        self.config = config
        self.lr = lr
        self.train_config = None  # set by decoderlab.training for AdamW + schedule
        cfg = config

        self.we = nn.Embedding(num_embeddings=cfg.num_tokens, embedding_dim=cfg.d_model)
        rope = None
        if cfg.position == "sinusoidal":
            self.pe = PositionEncoding(d_model=cfg.d_model, max_len=cfg.max_len)
        elif cfg.position == "learned":
            self.pe = LearnedPositionEncoding(cfg.d_model, cfg.max_len)
        else:
            self.pe = None
            if cfg.position == "rope":
                rope = RotaryEmbedding(cfg.d_head, cfg.max_len)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([DecoderBlock(cfg, rope) for _ in range(cfg.n_layer)])
        self.norm_f = make_norm(cfg)
        self.fc_layer = nn.Linear(in_features=cfg.d_model, out_features=cfg.num_tokens, bias=cfg.lm_head_bias)
        if cfg.tie_weights:
            self.fc_layer.weight = self.we.weight
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)
        if cfg.init == "gpt2":
            self.apply(self._gpt2_init)
            for name, p in self.named_parameters():
                if name.endswith("attention.proj.weight") or name.endswith("mlp.proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.zero_init:  # every block starts as the identity
            for name, p in self.named_parameters():
                if name.endswith(("attention.proj.weight", "mlp.proj.weight")):
                    nn.init.zeros_(p)

    @staticmethod
    def _gpt2_init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # -- sizes ------------------------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def num_tokens(self) -> int:
        return self.config.num_tokens

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared tensors counted once). ``non_embedding`` leaves out the word and
        learned position embeddings (and ``fc_layer.weight`` when it is tied to them)."""
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        if non_embedding:
            total -= self.we.weight.numel()
            if isinstance(self.pe, LearnedPositionEncoding):
                total -= self.pe.weight.numel()
        return total

    # -- forward ----------------------------------------------------------------------------------------------
    def check_token_ids(self, token_ids: torch.Tensor) -> None:
        """Raise ``ValueError`` for ids outside [0, num_tokens), a bad dtype/shape, or T > max_len."""
        if not isinstance(token_ids, torch.Tensor):
            raise TypeError(f"token_ids must be a torch.Tensor of integer ids, got {type(token_ids).__name__}")
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be integer ids, got dtype {token_ids.dtype}")
        if token_ids.dim() not in (1, 2):
            raise ValueError(f"token_ids must have shape (T,) or (B, T), got {tuple(token_ids.shape)}")
        if token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.config.num_tokens:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} is out of range; allowed ids are 0 .. {self.config.num_tokens - 1} "
                    f"(num_tokens={self.config.num_tokens})"
                )

    def forward(self, token_ids: torch.Tensor, *, padding_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        self.check_token_ids(token_ids)
        unbatched = token_ids.dim() == 1
        if unbatched:
            token_ids = token_ids.unsqueeze(0)
        t = token_ids.size(1)
        if positions is None:
            start = cache.length if cache is not None else 0
            if start + t > self.config.max_len:
                raise ValueError(
                    f"sequence length T={start + t} is longer than max_len={self.config.max_len}; "
                    f"allowed: T <= {self.config.max_len}"
                )
            if start:
                positions = torch.arange(start, start + t, device=token_ids.device)
        x = self.we(token_ids)
        if self.pe is not None:
            x = self.pe(x, positions)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, padding_mask=padding_mask, positions=positions,
                      cache=None if cache is None else cache.layers[i])
        if cache is not None:
            cache.advance(t)
        logits = self.fc_layer(self.norm_f(x))
        return logits[0] if unbatched else logits

    # -- Lightning --------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        if self.train_config is not None:
            from .training import configure_optimizers

            return configure_optimizers(self, self.train_config)
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def compute_loss(self, batch) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of ``batch = (inputs, labels)``; labels of -100 are ignored."""
        input_tokens, labels = batch[0], batch[1]
        output = self.forward(input_tokens)
        return self.loss(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False,
                 batch_size=batch[0].shape[0] if batch[0].dim() > 1 else 1)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=batch[0].shape[0] if batch[0].dim() > 1 else 1)
        return loss
