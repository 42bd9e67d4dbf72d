"""Fine-tuning on conversations (:func:`finetune`): supervised (masked loss, exact per-step normalisation,
evaluation) or preference tuning (DPO), optionally through LoRA adapters, ending in a chat checkpoint that
stores its template. (The package is not named ``finetune``: importing a submodule sets the package attribute
of its name, so ``decoderlab.finetune`` could not stay the function.)

It sits above :mod:`decoderlab.chat` (templates, rendering, replies) and :mod:`decoderlab.training` (the run
plumbing and the masked rows every method shares, :mod:`decoderlab.training.rows`), which do not know each
other. One room per method, each ending with its parts (:class:`~.method.Method`):

    sft          supervised fine-tuning: conversations -> masked rows -> the step-normalised cross-entropy
                 (SFTModule), evaluate_chat (loss, bits per byte, end of turn, exact match), FinetuneSummary
    dpo          DPO: TRL's preference rows read and rendered, the DPO loss against the frozen starting model
                 (DPOModule), held-out reward margin and accuracy, PreferenceSummary
    method       Method (a method's parts) and Job (the run as a method sees it)
    start        the template, the starting model (a base from anywhere), the held-out split, the data digest,
                 the padding id
    run          finetune, and METHODS: the method chosen once by name

Sources: the masked-loss SFT recipe as in nanochat ``chat_sft``, litgpt ``finetune`` and TRL ``SFTTrainer``
(prompt tokens at -100); per-token normalisation across accumulation as discussed in Hugging Face
transformers' gradient-accumulation fix (2024); DPO as TRL's ``DPOTrainer``.
"""

from ..config.defaults import FINETUNE_TRAIN
from .dpo import PreferencePair, PreferenceSummary, evaluate_preferences, format_preferences, load_preferences
from .run import METHODS, finetune
from .sft import FinetuneSummary, build_examples, evaluate_chat, format_evaluation
from .start import pad_id_for

#: the ``TrainConfig`` fields :func:`finetune` sets from a base checkpoint when no ``train_config`` is given
#: (from scratch and with the lesson's template: ``decoderlab.config.recipes.finetune_defaults``)
FINETUNE_DEFAULTS = FINETUNE_TRAIN

__all__ = ["FINETUNE_DEFAULTS", "build_examples", "pad_id_for", "evaluate_chat", "format_evaluation",
           "FinetuneSummary", "finetune", "METHODS", "PreferencePair", "PreferenceSummary", "evaluate_preferences",
           "format_preferences", "load_preferences"]
