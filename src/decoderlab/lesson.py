"""The lessons' own pieces, with their names, arguments and numbers (``../shared/seeds``).

- ``SelfAttention`` (StatQuest, "Coding Self-Attention in PyTorch") and ``Attention`` ("Coding a ChatGPT Like
  Transformer From Scratch in PyTorch"): the lessons' classes, W_q / W_k / W_v and softmax(Q Kᵀ / sqrt(d_k)) V;
- the pair scheme: ``LESSON_PAIRS`` ("what is statquest" / "statquest is what" -> "awesome"), the lesson's
  vocabulary, and prompt ``<EOS>`` response -> inputs and labels; ``LESSON_TEMPLATE``, the same scheme as the
  fields of a chat template (``decoderlab.chat.TEMPLATES["lesson"]``), which a trained pair model stores;
- ``greedy_response``: the lesson's greedy loop (the whole sequence through the model for every token).

The model itself (``DecoderOnlyTransformer``, whose one-head, d_model-2 preset is the lesson's model) lives in
:mod:`decoderlab.model`; training on the pairs (``train_pairs``) in :mod:`decoderlab.training`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from .attention import check_last_dim, check_mask
from .tokenizers import EOS, Tokenizer, WordTokenizer

#: The lesson fills masked similarities with -1e9 ("an approximation of negative infinity").
LESSON_MASK_VALUE = -1e9


def _lesson_dims(x: torch.Tensor, row_dim: int, col_dim: int) -> tuple[int, int]:
    """The lesson's row/col indexes, shifted past any leading batch dimensions."""
    lead = x.dim() - 2
    return row_dim + lead if row_dim >= 0 else row_dim, col_dim + lead if col_dim >= 0 else col_dim


class _LessonAttention(nn.Module):
    """What the lesson's two classes share: the weights W_q, W_k, W_v and the math of the lesson."""

    def __init__(self, d_model: int = 2, row_dim: int = 0, col_dim: int = 1):
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model must be a positive integer, got {d_model!r}")
        self.d_model = d_model
        self.W_q = nn.Linear(in_features=d_model, out_features=d_model, bias=False)
        self.W_k = nn.Linear(in_features=d_model, out_features=d_model, bias=False)
        self.W_v = nn.Linear(in_features=d_model, out_features=d_model, bias=False)
        self.row_dim = row_dim
        self.col_dim = col_dim

    def _attend(self, encodings_for_q, encodings_for_k, encodings_for_v, mask=None) -> torch.Tensor:
        q = self.W_q(encodings_for_q)
        k = self.W_k(encodings_for_k)
        v = self.W_v(encodings_for_v)
        dtype = v.dtype
        if dtype in (torch.float16, torch.bfloat16):
            # half precision: the similarities, the -1e9 fill and the softmax in float32 (float16 cannot hold
            # -1e9, and Q Kᵀ overflows it past 65504); the percents are applied to V in its own dtype
            q, k = q.float(), k.float()
        row, col = _lesson_dims(k, self.row_dim, self.col_dim)
        sims = torch.matmul(q, k.transpose(dim0=row, dim1=col))
        scaled_sims = sims / torch.tensor(k.size(col) ** 0.5)
        if mask is not None:
            mask = check_mask(mask, scaled_sims.shape)
            scaled_sims = scaled_sims.masked_fill(mask=mask, value=LESSON_MASK_VALUE)
        attention_percents = F.softmax(scaled_sims, dim=col).to(dtype)
        attention_scores = torch.matmul(attention_percents, v)
        return attention_scores


class SelfAttention(_LessonAttention):
    """Self-attention exactly as the lesson codes it (StatQuest, "Coding Self-Attention in PyTorch").

    ``W_q``, ``W_k``, ``W_v`` are ``nn.Linear(d_model, d_model, bias=False)``; ``forward`` returns
    softmax(Q Kᵀ / sqrt(d_k)) V.

    Args:
        d_model: number of encoded values per token.
        row_dim, col_dim: the lesson's row and column indexes of an unbatched (T, d_model) input. For batched
            input (B, T, d_model) they are shifted past the batch dimension, so each row of a batch gives the
            same numbers as that row alone.

    Shapes: ``token_encodings`` (T, d_model) or (B, T, d_model) -> same shape.

    Raises:
        ValueError: the last dimension of the input is not d_model.

    Reference (the lesson): after ``torch.manual_seed(42)``, ``SelfAttention(d_model=2, row_dim=0, col_dim=1)``
    on ``[[1.16, 0.23], [0.57, 1.36], [4.41, -2.16]]`` gives
    ``[[1.0100, 1.0641], [0.2040, 0.7057], [3.4989, 2.2427]]``.
    """

    def forward(self, token_encodings: torch.Tensor) -> torch.Tensor:
        check_last_dim(token_encodings, self.d_model, "token_encodings")
        return self._attend(token_encodings, token_encodings, token_encodings)


class Attention(_LessonAttention):
    """(Masked) attention exactly as the lesson codes it (StatQuest, "Coding a ChatGPT Like Transformer").

    Queries, keys and values may come from different encodings, so this also does encoder-decoder
    (cross) attention: queries from one sequence of length T_q, keys and values from another of length T_k.

    Args:
        d_model: number of encoded values per token.
        row_dim, col_dim: the lesson's row and column indexes (shifted past batch dimensions for batched input).

    Shapes: ``encodings_for_q`` (T_q, d_model) or (B, T_q, d_model); ``encodings_for_k`` and
    ``encodings_for_v`` (T_k, d_model) or (B, T_k, d_model); ``mask`` boolean, broadcastable to (T_q, T_k)
    (or (B, T_q, T_k)), **True marks a similarity to ignore**: it is filled with -1e9 before the softmax, as
    in the lesson. Returns (T_q, d_model) or (B, T_q, d_model). In float16/bfloat16 the similarities, the
    -1e9 fill and the softmax are computed in float32 (float16 cannot hold -1e9), the output has the input's
    dtype.

    Raises:
        ValueError: a last dimension is not d_model; keys and values differ in length; the mask cannot
            broadcast to the similarities.
    """

    def forward(
        self,
        encodings_for_q: torch.Tensor,
        encodings_for_k: torch.Tensor,
        encodings_for_v: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_last_dim(encodings_for_q, self.d_model, "encodings_for_q")
        check_last_dim(encodings_for_k, self.d_model, "encodings_for_k")
        check_last_dim(encodings_for_v, self.d_model, "encodings_for_v")
        if encodings_for_k.shape[:-1] != encodings_for_v.shape[:-1]:
            raise ValueError(
                f"encodings_for_k {tuple(encodings_for_k.shape)} and encodings_for_v "
                f"{tuple(encodings_for_v.shape)} must have the same number of tokens"
            )
        return self._attend(encodings_for_q, encodings_for_k, encodings_for_v, mask)


#: ignored by ``nn.CrossEntropyLoss`` (its default ignore_index)
IGNORE_INDEX = -100

#: The lesson's two prompt/response pairs.
LESSON_PAIRS: list[tuple[str, str]] = [("what is statquest", "awesome"), ("statquest is what", "awesome")]

#: The pair scheme ``prompt <EOS> response <EOS>`` as the fields of a chat template (``decoderlab.chat.ChatTemplate``):
#: the user's text has no opener and no end, the ``<EOS>`` after it opens the assistant turn, and the one after
#: the response ends it. One definition for the lesson's training (``train_pairs`` stores it in ``meta.json``) and
#: the ``lesson`` chat template.
LESSON_TEMPLATE = {"name": "lesson", "user": None, "assistant": EOS, "end": EOS, "system": None,
                   "end_after_user": False}


def lesson_tokenizer() -> WordTokenizer:
    """The lesson's vocabulary: what=0, is=1, statquest=2, awesome=3, <EOS>=4."""
    return WordTokenizer(["what", "is", "statquest", "awesome"])


def tokenizer_for_pairs(pairs: Sequence[tuple[str, str]]) -> WordTokenizer:
    """A ``WordTokenizer`` over the words of the pairs (first-appearance order), then ``<EOS>``, then
    ``<PAD>`` only if the pairs have different lengths (so the lesson's pairs give the lesson's 5 tokens)."""
    check_pairs(pairs)
    lengths = {len(p.split()) + len(r.split()) for p, r in pairs}
    return WordTokenizer.from_texts([t for pair in pairs for t in pair], pad=len(lengths) > 1)


def check_pairs(pairs) -> None:
    """Raise ``ValueError`` (naming the pair's index) unless ``pairs`` is a non-empty list of
    (prompt, response) string tuples with non-empty prompts."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs must be a non-empty list of (prompt, response) string pairs")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise ValueError(f"pair {i} must be a (prompt, response) tuple of two strings, got {pair!r}")
        if not pair[0].split():
            raise ValueError(f"pair {i} has an empty prompt")


def pair_inputs_and_labels(
    pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn (prompt, response) pairs into training inputs and labels exactly as the lesson does.

    inputs = prompt + ``<EOS>`` + response; labels = inputs shifted left by one, ending in ``<EOS>``. Pairs
    of different lengths are padded at the end: inputs with ``<PAD>``, labels with -100 (ignored by the loss).

    Returns (inputs, labels), both (N, T) int64 tensors.

    Raises:
        ValueError: empty/malformed pairs; the tokenizer has no ``<EOS>``; padding is needed but the tokenizer
            has no ``<PAD>``.
        KeyError: a word not in the tokenizer's vocabulary.
    """
    check_pairs(pairs)
    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS} token, which the pair scheme needs")
    rows_in, rows_lab = [], []
    for prompt, response in pairs:
        ids = tokenizer.encode(prompt) + [eos] + tokenizer.encode(response)
        rows_in.append(ids)
        rows_lab.append(ids[1:] + [eos])
    t = max(len(r) for r in rows_in)
    if any(len(r) != t for r in rows_in) and tokenizer.pad_id is None:
        raise ValueError("the pairs have different lengths, so they need a <PAD> token, which the tokenizer lacks; "
                         "build it with WordTokenizer(..., pad=True) or tokenizer_for_pairs(pairs)")
    pad = tokenizer.pad_id
    inputs = torch.tensor([r + [pad] * (t - len(r)) for r in rows_in], dtype=torch.long)
    labels = torch.tensor([r + [IGNORE_INDEX] * (t - len(r)) for r in rows_lab], dtype=torch.long)
    return inputs, labels


def pair_dataloader(pairs, tokenizer, batch_size: int = 1, shuffle: bool = False) -> DataLoader:
    """The lesson's ``TensorDataset`` + ``DataLoader`` over :func:`pair_inputs_and_labels`."""
    inputs, labels = pair_inputs_and_labels(pairs, tokenizer)
    return DataLoader(TensorDataset(inputs, labels), batch_size=batch_size, shuffle=shuffle)


@torch.no_grad()
def greedy_response(model, prompt_ids: Sequence[int] | torch.Tensor, eos_id: int) -> list[int]:
    """The lesson's greedy loop for a model trained on prompt/response pairs.

    The prompt must end in ``<EOS>`` (``eos_id``): the library does not append it silently (the CLI does).
    Appends the argmax token, re-running the whole sequence each time as the lesson does, until ``<EOS>`` is
    produced or the sequence reaches max_len tokens.

    Args:
        model: a ``DecoderOnlyTransformer``.
        prompt_ids: (T,) token ids ending with ``eos_id``.
        eos_id: the id of ``<EOS>``.

    Returns:
        the generated ids (the response, ending with ``eos_id`` if the model produced it).

    Raises:
        ValueError: the prompt is empty, does not end in ``<EOS>``, or is already max_len long or longer.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; it must end with the <EOS> token")
    if int(ids[-1]) != eos_id:
        raise ValueError(
            f"the prompt must end with <EOS> (id {eos_id}) for a model trained on prompt/response pairs; "
            f"it ends with id {int(ids[-1])}. Append <EOS> (the CLI does so for you)."
        )
    max_len = model.config.max_len
    if ids.numel() >= max_len:
        raise ValueError(f"the prompt has {ids.numel()} tokens; it must be shorter than max_len={max_len}")
    was_training = model.training
    model.eval()
    try:
        generated: list[int] = []
        while ids.numel() < max_len:
            predictions = model(ids)
            next_id = int(torch.argmax(predictions[-1, :]))
            generated.append(next_id)
            ids = torch.cat((ids, torch.tensor([next_id])))
            if next_id == eos_id:
                break
        return generated
    finally:
        model.train(was_training)
