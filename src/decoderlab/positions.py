"""Position information: the lesson's sinusoidal ``PositionEncoding``, learned positions, and rotary (RoPE).

Sources: sinusoidal -- Vaswani et al. 2017, section 3.5, and the StatQuest lesson; learned -- Radford et al.
2019 (GPT-2); rotary -- Su et al. 2021, "RoFormer", eq. (34).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .config.names import POSITIONS, ROPE_LAYOUTS


def _check_length(t: int, max_len: int) -> None:
    if t > max_len:
        raise ValueError(f"sequence length T={t} is longer than max_len={max_len}; allowed: T <= {max_len}")


def check_positions(positions: torch.Tensor, max_len: int) -> None:
    """Raise ``ValueError`` unless every position is in 0 .. max_len - 1 (a negative position would silently
    index the table from its end)."""
    if positions.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(positions))
    if lo < 0:
        raise ValueError(f"positions must be >= 0 (the first token is at position 0), got {lo}; "
                         f"allowed: 0 .. {max_len - 1}")
    _check_length(hi + 1, max_len)


def sinusoidal_table(max_len: int, d_model: int) -> torch.Tensor:
    """pe[pos, 2i] = sin(pos / 10000^(2i/d_model)), pe[pos, 2i+1] = cos(pos / 10000^(2i/d_model)).

    Shape (max_len, d_model); an odd d_model simply has one more sine column than cosine columns.
    """
    pe = torch.zeros(max_len, d_model)
    position = torch.arange(start=0, end=max_len, step=1).float().unsqueeze(1)
    embedding_index = torch.arange(start=0, end=d_model, step=2).float()
    div_term = 1 / torch.tensor(10000.0) ** (embedding_index / d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])
    return pe


class PositionEncoding(nn.Module):
    """Sinusoidal position encoding, as in the lesson.

    Buffer ``pe`` has shape (max_len, d_model). ``forward(word_embeddings)`` takes (T, d_model) or
    (B, T, d_model) and adds the first T rows of ``pe`` (or the rows at ``positions``, shape (T,) or (B, T),
    when given -- used by the KV cache and by left-padded batches).

    ``check=False`` skips the range check of ``positions`` (reading their smallest and largest value waits
    for the device): the model checks them once per call, not once per layer and token.

    Raises:
        ValueError: T > max_len (naming both), a position outside 0 .. max_len - 1, or the last dimension is
            not d_model.
    """

    def __init__(self, d_model: int = 2, max_len: int = 6):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.register_buffer("pe", sinusoidal_table(max_len, d_model))

    def forward(self, word_embeddings: torch.Tensor, positions: torch.Tensor | None = None, *,
                check: bool = True) -> torch.Tensor:
        if word_embeddings.shape[-1] != self.d_model:
            raise ValueError(
                f"word_embeddings has last dimension {word_embeddings.shape[-1]}, but d_model is {self.d_model}"
            )
        t = word_embeddings.size(-2)
        if positions is None:
            _check_length(t, self.max_len)
            return word_embeddings + self.pe[:t, :]
        if check:
            check_positions(positions, self.max_len)
        return word_embeddings + self.pe[positions]


class LearnedPositionEncoding(nn.Module):
    """Learned absolute positions (GPT-2's ``wpe``): an ``nn.Embedding(max_len, d_model)`` added to the input.

    Shapes and ``check`` as :class:`PositionEncoding`. Raises ``ValueError`` for T > max_len or a position
    outside 0 .. max_len - 1.
    """

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.d_model = d_model
        self.max_len = max_len
        self.weight = nn.Parameter(torch.zeros(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, word_embeddings: torch.Tensor, positions: torch.Tensor | None = None, *,
                check: bool = True) -> torch.Tensor:
        t = word_embeddings.size(-2)
        if positions is None:
            _check_length(t, self.max_len)
            return word_embeddings + self.weight[:t]
        if check:
            check_positions(positions, self.max_len)
        return word_embeddings + self.weight[positions]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to queries and keys of shape (B, H, T, d_head), d_head even.

    Pair i of a head is turned by the angle pos * base^(-2i/d_head) (RoFormer eq. 34). ``layout`` says which
    two values make pair i: "interleaved" (x[2i], x[2i+1]), RoFormer's; "rotate_half" (x[i], x[i + d_head/2]),
    the halves of Hugging Face's Llama family (``rotate_half``). The angles are computed as Hugging Face computes
    them (``1 / base^(2i/d_head)``, float32), so that the same weights give the same numbers.
    ``forward(x, positions=None, *, check=True)``: positions (T,) or (B, T); default 0..T-1;
    ``check=False`` skips their range check (the model checks them once per call, not per layer: see
    :class:`PositionEncoding`). Raises ``ValueError`` for T > max_len, a position outside 0 .. max_len - 1, an
    odd d_head or an unknown layout.
    """

    def __init__(self, d_head: int, max_len: int, base: float = 10000.0, layout: str = "interleaved"):
        super().__init__()
        if d_head % 2 != 0:
            raise ValueError(f"rope needs an even head size, got d_head={d_head}")
        if layout not in ROPE_LAYOUTS:
            raise ValueError(f"unknown rope layout {layout!r}; allowed: {', '.join(ROPE_LAYOUTS)}")
        self.d_head = d_head
        self.max_len = max_len
        self.base = float(base)
        self.layout = layout
        cos, sin = self._table()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._made = self._tables()

    def _table(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, (max_len, d_head/2): in float32 as Hugging Face makes them,
        or in float64 for a float64 model (whose numbers the float64 reference of ``verify`` then matches)."""
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.d_head, 2, dtype=torch.int64).to(dtype) / self.d_head))
        angles = torch.arange(self.max_len).to(dtype)[:, None] * inv_freq[None, :]  # (max_len, d_head/2)
        return angles.cos(), angles.sin()

    def materialize(self, device) -> None:
        """Compute cos/sin on ``device`` when they are still on the meta device (a model built there and
        loaded with ``assign=True``: the state dict does not hold them), so ``.to()``/``.cpu()`` work."""
        if self.cos.is_meta:
            cos, sin = self._table()
            self.cos, self.sin = cos.to(device), sin.to(device)
            self._made = self._tables()

    def _apply(self, fn, recurse=True):
        # cos/sin are not in the state dict (computed, not learned): after ``to_empty`` (the meta-device loading
        # pattern) they would hold uninitialised memory, so they are recomputed after every conversion
        # -- unless the conversion left them as they were (a model's layers share one table: nn.Module._apply visits
        # it once per layer, 18 recomputations of a 32768-position table for Gemma 3, ~1 s of its load)
        super()._apply(fn, recurse)
        if self.cos.device.type != "meta" and self._tables() != getattr(self, "_made", None):
            cos, sin = self._table(self.cos.dtype)
            self.cos = cos.to(self.cos.device, self.cos.dtype)
            self.sin = sin.to(self.sin.device, self.sin.dtype)
            self._made = self._tables()
        return self

    def _tables(self) -> tuple:
        """What identifies the tables held: their storage, dtype and device (a conversion that made new ones, or
        ``to_empty``'s uninitialised memory, changes it)."""
        return tuple((t.data_ptr(), t.dtype, t.device) for t in (self.cos, self.sin))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, check: bool = True) -> torch.Tensor:
        if self.cos.is_meta:  # built on the meta device and loaded with assign=True: the table was never made
            cos, sin = self._table()
            self.cos, self.sin = cos.to(x.device), sin.to(x.device)
        t = x.size(-2)
        if positions is None:
            _check_length(t, self.max_len)
            cos, sin = self.cos[:t], self.sin[:t]  # (T, d/2)
        else:
            if check:
                check_positions(positions, self.max_len)
            cos, sin = self.cos[positions], self.sin[positions]  # (T, d/2) or (B, T, d/2)
            if cos.dim() == 3:
                cos, sin = cos[:, None], sin[:, None]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.layout == "rotate_half":  # (written as Hugging Face's x cos + rotate_half(x) sin: the same sums)
            x1, x2 = x[..., : self.d_head // 2], x[..., self.d_head // 2 :]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        return torch.stack((r1, r2), dim=-1).flatten(-2)
