"""The Lightning side of SAE training: :class:`SAEModule` (one step: the model's activations at the hook, the
SAE's losses, decoder rows back to unit norm, dead features counted and resampled) and the run's callbacks
(a resumable checkpoint every N steps, progress lines)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import lightning as L
import torch

from ..glassbox.features import hook_activations
from ..glassbox.sae import SparseAutoencoder, resample_dead, sae_losses
from ..output import print_line
from ..waiting import clock

logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector").addFilter(
    lambda record: "weights_only" not in record.getMessage())

LIGHTNING_DIR = "lightning"
LAST_CKPT = "last.ckpt"


class SAEModule(L.LightningModule):
    """Trains ``sae`` on the activations of the frozen ``model`` at ``hook``.

    Each training batch is (inputs, targets) windows of token ids (``TokenDataModule``); the step reads the
    activations at ``hook`` (:func:`~decoderlab.glassbox.features.hook_activations`, the pass stopped there),
    flattens them to (N, d_in) and minimises :func:`~decoderlab.glassbox.sae.sae_losses`. Around the optimizer
    step: W_dec's gradient along its rows is dropped, and after it the rows are put back to unit norm.

    Dead features: ``steps_since_fired`` (d_sae,) counts the steps since each feature last fired; a feature is
    dead after ``dead_steps`` (the AuxK loss of TopK uses them), and every ``resample_every`` steps (until 3/4
    of the run) the dead ones are resampled from the inputs reconstructed worst
    (:func:`~decoderlab.glassbox.sae.resample_dead`) with their Adam moments reset. Step 0 sets b_dec to the
    mean of the first batch. Everything a step depends on is in the checkpoint, so a resumed run repeats an
    uninterrupted one.

    What the progress lines call dead is another count, the final evaluation's measure: the features that fired
    on none of the last tokens (:meth:`fired_on_none`, from ``last_fired``, the step each feature last fired --
    a resampled feature that has not fired since stays dead there, while ``steps_since_fired`` restarts).
    """

    def __init__(self, sae: SparseAutoencoder, model, hook: str, *, lr: float, steps: int,
                 l1_coefficient: float = 0.0, dead_steps: int = 100, resample_every: int = 0, seed: int = 0):
        super().__init__()
        self.sae = sae
        self._model = (model.eval().requires_grad_(False),)  # a tuple: not a submodule, not in the checkpoint
        self.hook, self.lr, self.steps = hook, float(lr), int(steps)
        self.l1_coefficient, self.dead_steps = float(l1_coefficient), int(dead_steps)
        self.resample_every, self.seed = int(resample_every), int(seed)
        self.register_buffer("steps_since_fired", torch.zeros(sae.d_sae, dtype=torch.long))
        self.register_buffer("last_fired", torch.zeros(sae.d_sae, dtype=torch.long))  # 1-based step; 0: never
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self.register_buffer("resampled_total", torch.zeros((), dtype=torch.long))
        self.last = {}
        self._x = None

    @property
    def resampled(self) -> int:
        """Features resampled so far (over the whole run, resumes included)."""
        return int(self.resampled_total)

    def dead(self) -> torch.Tensor:
        """(d_sae,) bool: the features that have not fired for ``dead_steps`` steps (resampled then)."""
        return self.steps_since_fired >= self.dead_steps

    def fired_on_none(self, window: int) -> tuple[int, int]:
        """``(n, steps)``: ``n`` features fired on none of the tokens of the last ``steps`` steps -- ``window``
        steps, or all done so far when fewer -- the measure the final evaluation reports on held-out tokens."""
        done = int(self.steps_done)
        steps = min(done, max(1, int(window)))
        return int((self.last_fired <= done - steps).sum()) if steps else 0, steps

    def training_step(self, batch, batch_idx):
        inputs = batch[0]
        x = hook_activations(self._model[0], inputs, self.hook).flatten(0, 1).to(self.sae.W_enc.dtype)
        if int(self.steps_done) == 0:
            with torch.no_grad():
                self.sae.b_dec.copy_(x.mean(0))
        losses = sae_losses(self.sae, x, l1_coefficient=self.l1_coefficient, dead=self.dead())
        active = losses.pop("features") > 0
        fired = active.any(0)
        self._l0 = float(active.sum(-1).float().mean())
        self.steps_since_fired += 1
        self.steps_since_fired[fired] = 0
        self.last_fired[fired] = self.steps_done + 1
        self._x = x
        self.last = {k: float(v.detach()) for k, v in losses.items()}
        self.last["l0"] = self._l0
        self.log_dict({"mse": self.last["mse"], "L0": self._l0}, prog_bar=True, on_step=True, on_epoch=False)
        return losses["loss"]

    def on_before_optimizer_step(self, optimizer):
        self.sae.remove_parallel_grad_()

    def optimizer_step(self, *args, **kwargs):
        """The step, then decoder rows back to unit norm and, on a resampling step, the dead resampled: all
        before the callbacks see the step (a checkpoint saved after it holds the finished step)."""
        super().optimizer_step(*args, **kwargs)
        self.sae.normalize_decoder_()
        self.steps_done += 1
        step = int(self.steps_done)
        if self.resample_every and step % self.resample_every == 0 and step <= 0.75 * self.steps:
            dead = self.dead()
            n = resample_dead(self.sae, self._x, dead, seed=self.seed * 1_000_003 + step)
            if n:
                self._reset_moments(dead)
                self.steps_since_fired[dead] = 0
                self.resampled_total += n
        self._x = None

    def _reset_moments(self, dead: torch.Tensor) -> None:
        opt = self.optimizers().optimizer if hasattr(self.optimizers(), "optimizer") else self.optimizers()
        where = {id(self.sae.W_enc): (slice(None), dead), id(self.sae.W_dec): (dead,), id(self.sae.b_enc): (dead,)}
        for p in (self.sae.W_enc, self.sae.W_dec, self.sae.b_enc):
            state = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key][where[id(p)]] = 0.0

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.sae.parameters(), lr=self.lr, betas=(0.9, 0.999))
        decay_from = int(0.8 * self.steps)  # SAELens's lr_decay_steps: a linear decay over the last 20%

        def factor(step: int) -> float:
            return 1.0 if step < decay_from else max(0.0, (self.steps - step) / max(1, self.steps - decay_from))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class SaveEvery(L.Callback):
    """``lightning/last.ckpt`` (the whole training state) every ``every`` steps and at the end, written to a
    temporary name and renamed, so an interrupted run resumes from its last save."""

    def __init__(self, run_dir: Path, every: int):
        self.path = Path(run_dir) / LIGHTNING_DIR / LAST_CKPT
        self.every = max(1, int(every))

    def _save(self, trainer) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        trainer.save_checkpoint(str(tmp))
        os.replace(tmp, self.path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            self._save(trainer)

    def on_train_end(self, trainer, pl_module):
        self._save(trainer)


class SAEProgress(L.Callback):
    """A line every ``every`` steps, and whenever ``seconds`` passed since the last one (no long silence when
    steps are slow), and at the last step::

        step 100/488  mse 1.234  auxk 0.01  L0 32.0  dead 3/1024 (fired on none of the last 65,536 tokens)
        9,100 tokens/s  elapsed 0:45  ETA 2:55

    (on one line). Dead is :meth:`SAEModule.fired_on_none` over ``window`` steps -- as many tokens as the final
    evaluation reads, so the two numbers measure one thing; the ETA is this session's time per step times the
    steps left, measured."""

    def __init__(self, steps: int, every: int, tokens_per_step: int, window: int = 1, stream=None,
                 seconds: float = 5.0):
        self.steps, self.every, self.tokens_per_step = int(steps), max(1, int(every)), int(tokens_per_step)
        self.window, self.stream, self.seconds = max(1, int(window)), stream, float(seconds)
        self._t = self._t0 = 0.0
        self._step = self._step0 = 0

    def on_train_start(self, trainer, pl_module):
        self._t = self._t0 = time.perf_counter()
        self._step = self._step0 = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step, now = trainer.global_step, time.perf_counter()
        if step % self.every and step != self.steps and now - self._t < self.seconds:
            return
        rate = (step - self._step) * self.tokens_per_step / max(now - self._t, 1e-9)
        self._t, self._step = now, step
        m = pl_module.last
        extra = f"  l1 {m['l1']:.4g}" if "l1" in m else f"  auxk {m.get('auxk', 0.0):.4g}"
        dead, steps = pl_module.fired_on_none(self.window)
        elapsed = now - self._t0
        eta = elapsed / max(step - self._step0, 1) * (self.steps - step)
        print_line(f"step {step:>{len(str(self.steps))}}/{self.steps}  mse {m['mse']:.5g}{extra}  L0 {m['l0']:.1f}  "
                   f"dead {dead}/{pl_module.sae.d_sae} (fired on none of the last {steps * self.tokens_per_step:,} "
                   f"tokens)  {rate:,.0f} tokens/s  elapsed {clock(elapsed)}  ETA {clock(eta)}", self.stream)
