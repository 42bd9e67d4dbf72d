"""Stop sequences: where generation ends, before emitting the stop."""

from __future__ import annotations

from typing import Sequence

import torch


def stop_sequences(stop, tokenizer, num_tokens: int) -> list[tuple[int, ...]]:
    """Normalise ``stop`` to a list of token-id sequences (see :func:`stream`)."""
    if stop is None:
        return []
    if isinstance(stop, torch.Tensor):
        stop = stop.tolist()
    if isinstance(stop, (int, str)) or (isinstance(stop, Sequence) and stop and
                                        all(isinstance(t, int) for t in stop) and not isinstance(stop, list)):
        # a single id, a single string, or a tuple of ids (one multi-token stop sequence)
        items = [stop]
    else:
        items = list(stop)
    seqs: list[tuple[int, ...]] = []
    for item in items:
        if isinstance(item, bool):
            raise TypeError(f"stop must be token ids or strings, got {item!r}")
        if isinstance(item, int):
            seq = (item,)
        elif isinstance(item, str):
            if item == "":
                raise ValueError("a stop string must not be empty")
            if tokenizer is None:
                raise TypeError(f"stop string {item!r} needs the tokenizer: pass tokenizer=... (or give token ids)")
            vocab = getattr(tokenizer, "token_to_id", None)
            try:
                if isinstance(vocab, dict) and item in vocab:  # one whole token, e.g. "<EOS>"
                    seq = (vocab[item],)
                else:
                    seq = tuple(tokenizer.encode(item))
            except (KeyError, ValueError) as e:
                msg = e.args[0] if e.args else e
                raise ValueError(f"stop string {item!r} cannot be encoded by the tokenizer: {msg}") from None
            if not seq:
                raise ValueError(f"stop string {item!r} encodes to no tokens")
        elif isinstance(item, (Sequence, torch.Tensor)):
            seq = tuple(int(t) for t in item)
            if not seq:
                raise ValueError("a stop sequence of token ids must not be empty")
        else:
            raise TypeError(f"stop must be token ids or strings, got {item!r}")
        bad = [t for t in seq if not 0 <= t < num_tokens]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is out of range; allowed ids are 0 .. {num_tokens - 1}")
        seqs.append(seq)
    return seqs


class StopMatcher:
    """Stops a stream of token ids before a stop sequence, holding back tokens that could start one.

    ``push(token)`` returns ``(ids safe to emit, matched stop sequence or None)``; ``flush()`` returns the
    held-back ids when generation ends without a match. Matching is on token ids: a stop string is matched
    when the model produces the ids ``tokenizer.encode(stop)``, not another tokenization of the same text.
    """

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences]
        self.held: list[int] = []

    def push(self, token: int) -> tuple[list[int], tuple[int, ...] | None]:
        held = self.held
        held.append(token)
        if not self.sequences:
            out, self.held = held, []
            return out, None
        for seq in self.sequences:
            if len(held) >= len(seq) and tuple(held[-len(seq):]) == seq:
                out, self.held = held[: len(held) - len(seq)], []
                return out, seq
        keep = 0  # the longest suffix of held that is a proper prefix of a stop sequence
        for seq in self.sequences:
            for k in range(min(len(seq) - 1, len(held)), keep, -1):
                if tuple(held[-k:]) == seq[:k]:
                    keep = k
                    break
        out, self.held = held[: len(held) - keep], held[len(held) - keep:]
        return out, None

    def flush(self) -> list[int]:
        out, self.held = self.held, []
        return out
