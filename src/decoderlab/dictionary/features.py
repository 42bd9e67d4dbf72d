"""An SAE run opened for reading its features: the SAE, the model it reads, the tokenizer, the hook, and the
held-out windows of its corpus (``decoderlab features``, the page's Features view)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..glassbox.features import held_out_windows
from ..glassbox.sae import SparseAutoencoder, check_sae_hook, sae_hook
from .run import load_sae_run, run_corpus


@dataclass
class OpenedSAE:
    """An SAE with the model it was trained on (see :func:`open_sae_run`)."""

    sae: SparseAutoencoder
    model: torch.nn.Module
    tokenizer: object
    hook: str
    settings: dict

    def held_out(self, tokens: int = 65_536) -> torch.Tensor:
        """(n, context + 1) the held-out split's non-overlapping windows, about ``tokens`` tokens of them."""
        from ..data import corpus_tokens, split_tokens

        text, val_fraction, _ = run_corpus(self.settings["checkpoint"], self.settings.get("data"))
        _, val = split_tokens(corpus_tokens(text, self.tokenizer), val_fraction)
        context = int(self.sae.metadata.get("context_size") or self.model.config.max_len)
        return held_out_windows(val, context, max(1, tokens // context))


def open_sae_run(run_dir, checkpoint=None, model=None, tokenizer=None) -> OpenedSAE:
    """The SAE of ``run_dir`` and the model its ``sae_run.json`` names (or ``checkpoint``; or a ``model`` and
    ``tokenizer`` already loaded, as the server's).

    Raises ``FileNotFoundError`` for a missing directory or checkpoint; ``ValueError`` when the SAE's hook or
    size does not fit the model, or no checkpoint is known (an SAE directory SAELens wrote)."""
    sae, settings = load_sae_run(run_dir)
    checkpoint = checkpoint or settings.get("checkpoint")
    if model is None:
        if checkpoint is None:
            raise ValueError(f"{run_dir} names no checkpoint (no sae_run.json): it was not written by "
                             "`decoderlab sae`")
        from ..chat import load_model

        loaded = load_model(checkpoint, dtype="float32")  # the activations its SAE was trained on
        model, tokenizer = loaded.model.eval(), loaded.tokenizer
    hook = check_sae_hook(model, sae_hook(sae, run_dir))
    from ..glassbox.features import hook_activations

    d_in = hook_activations(model, torch.zeros(1, 1, dtype=torch.long), hook).shape[-1]
    if d_in != sae.d_in:
        raise ValueError(f"the SAE in {Path(run_dir)} reads d_in={sae.d_in} at {hook}, this model has {d_in} there")
    return OpenedSAE(sae, model, tokenizer, hook, {**settings, "checkpoint": checkpoint})
