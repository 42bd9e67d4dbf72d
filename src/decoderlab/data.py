"""Data: text -> token ids -> training batches.

The lesson's pair scheme (prompt / response -> inputs and labels) lives here; the corpus -> memmap pipeline
and the ``LightningDataModule`` for language-model training live here too.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

from .tokenizers import EOS, Tokenizer, WordTokenizer

#: ignored by ``nn.CrossEntropyLoss`` (its default ignore_index)
IGNORE_INDEX = -100

#: The lesson's two prompt/response pairs.
LESSON_PAIRS: list[tuple[str, str]] = [("what is statquest", "awesome"), ("statquest is what", "awesome")]


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
