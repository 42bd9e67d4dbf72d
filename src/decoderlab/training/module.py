"""``LitModel``: the Lightning wrapper that trains a ``DecoderOnlyTransformer``.

The model is a plain ``nn.Module`` so that loading, generating, serving and tracing never import Lightning;
this ``LightningModule`` adds the lesson's ``training_step`` (cross-entropy, labels of -100 ignored) and
``validation_step``, and the optimizer: the lesson's Adam(lr=0.1) (``model.configure_optimizers()``), or
AdamW with warm-up and cosine decay when a :class:`~decoderlab.training.config.TrainConfig` is given.
"""

from __future__ import annotations

import lightning as L
import torch

from .config import TrainConfig, apply_train_config, configure_optimizers


class LitModel(L.LightningModule):
    """Wraps ``model`` (a ``DecoderOnlyTransformer``) for ``lightning.Trainer``.

    Args:
        model: the model; its parameters are this module's (``self.model``), so the trained model is
            ``lit.model`` with no copy.
        train_config: None for the lesson's optimizer (``model.configure_optimizers()``), or a ``TrainConfig``
            for AdamW + schedule (``configure_optimizers(model, train_config)``).

    ``training_step((inputs, labels), i)``: inputs/labels (B, T) or (T,); returns the mean cross-entropy in
    nats per supervised token (``model.compute_loss``), logged as ``train_loss``; ``validation_step`` returns
    the mean of its batch and logs it as ``val_loss`` without a ``train_config`` (a language-model run logs
    the exact ``val_loss`` over all its validation targets from ``LMMetrics`` instead).
    """

    def __init__(self, model: torch.nn.Module, train_config: TrainConfig | None = None):
        super().__init__()
        self.model = model
        self.train_config = train_config

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @staticmethod
    def _batch_size(batch) -> int:
        return batch[0].shape[0] if batch[0].dim() > 1 else 1

    def training_step(self, batch, batch_idx):
        loss = self.model.compute_loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=self._batch_size(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model.compute_loss(batch)
        if self.train_config is None:
            self.log("val_loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
                     batch_size=self._batch_size(batch))
        return loss

    def on_train_start(self):
        # after a checkpoint was restored: the train config's hyper-parameters and schedule from this step on
        if self.train_config is not None:
            sched = self.lr_schedulers()
            apply_train_config(self.optimizers(use_pl_optimizer=False), sched, self.train_config,
                               self.trainer.global_step)

    def configure_optimizers(self):
        if self.train_config is None:
            return self.model.configure_optimizers()
        return configure_optimizers(self.model, self.train_config)
