"""Generation: logits -> tokens. The lesson's greedy loop, and the key/value cache used for fast decoding.

Inference lives apart from the model (as nanochat's engine apart from its gpt.py): the model only knows how
to run a forward pass over new tokens with an optional ``KVCache``.
"""

from __future__ import annotations

from typing import Sequence

import torch


class LayerKVCache:
    """Keys and values of one layer, preallocated once: k, v of shape (B, H, capacity, d_head).

    ``update(k_new, v_new)`` writes the new keys/values (B, H, T_new, d_head) after the ones already held and
    returns views of all of them, (B, H, length + T_new, d_head). The owning :class:`KVCache` advances the
    shared length once per forward pass.
    """

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.owner.length
        end = start + k_new.size(2)
        if end > self.owner.capacity:
            raise ValueError(f"KV cache is full: {end} tokens would exceed its capacity of {self.owner.capacity}")
        if self.k is None or self.k.size(0) != k_new.size(0) or self.k.dtype != k_new.dtype:
            b, h, _, d = k_new.shape
            self.k = k_new.new_empty(b, h, self.owner.capacity, d)
            self.v = v_new.new_empty(b, h, self.owner.capacity, d)
        self.k[:, :, start:end] = k_new
        self.v[:, :, start:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """A per-layer key/value cache for a ``DecoderOnlyTransformer``, allocated once per generation call.

    Args:
        n_layer: number of decoder blocks.
        capacity: most tokens it holds (the model's max_len).

    ``length`` is the number of positions already cached; the model's forward pass reads it (new tokens get
    positions length .. length+T-1) and then calls ``advance(T)``. ``reset()`` empties it for reuse.
    """

    def __init__(self, n_layer: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.layers = [LayerKVCache(self) for _ in range(n_layer)]

    @classmethod
    def for_model(cls, model) -> "KVCache":
        return cls(model.config.n_layer, model.config.max_len)

    def advance(self, t: int) -> None:
        self.length += t

    def reset(self) -> None:
        self.length = 0


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
