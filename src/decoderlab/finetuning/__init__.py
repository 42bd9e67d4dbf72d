"""Fine-tuning on conversations (:func:`finetune`): supervised (masked loss, exact per-step normalisation,
evaluation) or preference tuning (DPO), optionally through LoRA adapters, ending in a chat checkpoint that
stores its template. (The package is not named ``finetune``: importing a submodule sets the package attribute
of its name, so ``decoderlab.finetune`` could not stay the function.)

It sits above :mod:`decoderlab.chat` (templates, rendering, replies), :mod:`decoderlab.feedback` (preference
rows) and :mod:`decoderlab.training` (the Lightning pieces: ``training.sft``, ``training.dpo``), which do not
know each other. The supervised pipeline, in order:

1. conversations (``decoderlab.chat.load_conversations``) -> ``template.render`` -> ``(ids, mask)``;
2. :func:`~decoderlab.training.sft.shift_for_training` -- the only place where the label shift happens:
   inputs = ids[:-1], labels = ids[1:] where the mask of ids[1:] is True, else -100 (so only assistant tokens
   and the end of turn after them are targets), after truncating to max_len + 1 tokens; rows left with no
   target are dropped and counted;
3. :class:`~decoderlab.training.sft.SFTBatches` -- optimizer step s uses a fixed set of ``batch_size *
   accumulate * world_size`` rows (seeded shuffles, epoch after epoch); every micro-batch carries the number
   of supervised tokens of its whole step (all micro-batches, all processes), padded with a pad id that is
   never the end of turn (labels -100 there);
4. :class:`~decoderlab.training.sft.SFTModule` (a ``LitModel``) -- ``sum of per-token cross-entropy /
   supervised tokens of the step``, so the loss (and gradient) of an optimizer step is the mean over every
   supervised token of the step, not a mean of per-batch means (scaled by accumulate * world_size only to undo
   Lightning's division by accumulate and DDP's gradient averaging);
5. evaluation on held-out conversations (:func:`evaluate_chat`): loss and bits per byte over assistant
   tokens, token accuracy, end-of-turn rate and exact match of greedy replies.

DPO (``method="dpo"``): TRL's preference rows -> both sides rendered with the template, the mask on each
completion (:func:`decoderlab.feedback.render_pair`) -> pair batches on the same step-exact schedule -> the DPO
loss against the starting model, frozen; held-out reward margin and accuracy (:func:`evaluate_preferences`).

    evaluation   the rows of a run, the padding id, evaluate_chat, format_evaluation
    start        the template, the starting model (a base from anywhere), the held-out split, the data digest
    supervised   SFT's data, rows and FinetuneSummary
    preference   DPO's data, rows, held-out metrics and PreferenceSummary
    run          finetune

Sources: the masked-loss SFT recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer``
(prompt tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face
transformers' gradient-accumulation fix (2024); DPO as TRL's ``DPOTrainer``.
"""

from ..config.defaults import FINETUNE_TRAIN
from ..training.sft import IGNORE_INDEX, Examples, SFTBatches, SFTDataModule, SFTModule, collate, masked_ce_sum, \
    shift_for_training
from .evaluation import build_examples, evaluate_chat, format_evaluation, pad_id_for
from .preference import PreferenceSummary, evaluate_preferences, format_preferences
from .run import METHODS, finetune
from .supervised import FinetuneSummary

#: the ``TrainConfig`` fields :func:`finetune` sets from a base checkpoint when no ``train_config`` is given
#: (from scratch and with the lesson's template: ``decoderlab.config.recipes.finetune_defaults``)
FINETUNE_DEFAULTS = FINETUNE_TRAIN

__all__ = ["FINETUNE_DEFAULTS", "IGNORE_INDEX", "Examples", "SFTBatches", "SFTDataModule", "SFTModule", "collate",
           "masked_ce_sum", "shift_for_training", "build_examples", "pad_id_for", "evaluate_chat", "format_evaluation",
           "FinetuneSummary", "finetune", "METHODS", "PreferenceSummary", "evaluate_preferences",
           "format_preferences"]
