"""``LitModel``: the Lightning wrapper that trains a ``DecoderOnlyTransformer``.

The model is a plain ``nn.Module`` so that loading, generating, serving and tracing never import Lightning;
this ``LightningModule`` adds the lesson's ``training_step`` (cross-entropy, labels of -100 ignored) and
``validation_step``, and the optimizer: the lesson's Adam(lr=0.1) (``model.configure_optimizers()``), or
AdamW with warm-up and cosine decay when a :class:`~decoderlab.config.TrainConfig` is given.
"""

from __future__ import annotations

import copy

import lightning as L
import torch

from ..config.train import TrainConfig
from .optim import apply_train_config, configure_optimizers, group_names
from .strategy import FSDPStrategy, shard_model


class LitModel(L.LightningModule):
    """Wraps ``model`` (a ``DecoderOnlyTransformer``) for ``lightning.Trainer``.

    Args:
        model: the model; its parameters are this module's (``self.model``), so the trained model is
            ``lit.model`` with no copy.
        train_config: None for the lesson's optimizer (``model.configure_optimizers()``), or a ``TrainConfig``
            for AdamW + schedule (``configure_optimizers(model, train_config)``).

    ``training_step((inputs, labels), i)``: inputs/labels (B, T) or (T,); returns the mean cross-entropy in
    nats per supervised token (``model.compute_loss``), logged as ``train_loss`` (with a ``train_config`` for
    the loggers only, not the progress bar: a progress-bar metric is read back to the host every step);
    ``validation_step`` returns the mean of its batch and logs it as ``val_loss`` without a ``train_config`` (a
    language-model run logs the exact ``val_loss`` over all its validation targets from ``LMMetrics`` instead). The steps skip the
    model's per-forward range check of the ids (a host sync): the data was checked where it came from.

    The optimizer's parameter groups are named here, on the plain model, before any strategy wraps it
    (:func:`~decoderlab.training.optim.group_names`); under decoderlab's ``--strategy fsdp``
    (:class:`~decoderlab.training.strategy.FSDPStrategy`) ``configure_model`` shards each decoder block.
    """

    def __init__(self, model: torch.nn.Module, train_config: TrainConfig | None = None):
        super().__init__()
        self.model = model
        self.train_config = train_config
        self.group_names = None if train_config is None else group_names(model, train_config.optimizer)

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @staticmethod
    def _batch_size(batch) -> int:
        return batch[0].shape[0] if batch[0].dim() > 1 else 1

    def training_step(self, batch, batch_idx):
        loss = self.model.compute_loss(batch, check_ids=False)
        # the lesson's bar shows the loss; a run with a TrainConfig reads it back at logging steps only
        self.log("train_loss", loss, prog_bar=self.train_config is None, on_step=True, on_epoch=False,
                 batch_size=self._batch_size(batch))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model.compute_loss(batch, check_ids=False)
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

    def configure_model(self):
        # decoderlab's FSDP: FSDP2 units per decoder block, made once the processes and their mesh exist
        if isinstance(self.trainer.strategy, FSDPStrategy):
            shard_model(self.model, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        if self.train_config is None:
            return self.model.configure_optimizers()
        trainer = getattr(self, "_trainer", None)
        return configure_optimizers(self.model, self.train_config, self.group_names,
                                    precision=None if trainer is None else trainer.precision)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with no gradients: the reference model of DPO and of the RL KL penalty (the modules
    that hold it run it in eval mode). Take it before LoRA adapters are put on ``model``: the reference is the
    starting model."""
    return copy.deepcopy(model).requires_grad_(False)
