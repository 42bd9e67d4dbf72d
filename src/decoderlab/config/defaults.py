"""The defaults of decoderlab's settings as plain data (numbers, strings, dicts; no dataclasses, no torch).

Each value is defined here once: ``TrainConfig`` (:mod:`.train`) and ``ServeLimits`` (:mod:`.limits`) take
their field defaults from these dicts, and the command line's ``--help`` reads them without building a class
(importing ``dataclasses`` alone costs about as much as ``argparse``; ``bench/startup.py``).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------

#: ``TrainConfig``'s field defaults: nanoGPT's CPU "baby" recipe (AdamW 1e-3 cosine to 1e-4 over 2,000 steps
#: of 12 windows); see ``TrainConfig`` for what each field means
TRAIN_DEFAULTS = dict(
    max_steps=2000, batch_size=12, lr=1e-3, min_lr=1e-4, warmup=100, weight_decay=0.1, betas=(0.9, 0.99),
    eps=1e-8, grad_clip=1.0, accumulate=1, precision="auto", compile=False, seed=42, eval_every=250,
    val_batches=None, val_batch_size=64, val_fraction=0.1, log_every=50, num_workers=0, fused=None,
    optimizer="adamw", muon_lr=0.05, muon_momentum=0.95, muon_weight_decay=0.0, schedule="cosine",
    cooldown=0.4, full_val_at_end=False, full_val_below=None, group_by_length=False,
)

#: the ``TrainConfig`` fields ``decoderlab.finetune`` sets when no ``train_config`` is given (the rest are
#: ``TrainConfig``'s defaults): a shorter run at a lower learning rate than pretraining
FINETUNE_TRAIN = {"max_steps": 500, "batch_size": 16, "lr": 3e-4, "min_lr": 3e-5, "warmup": 20, "eval_every": 100}

#: the ``TrainConfig`` fields a fine-tuning from scratch (``preset=``, no base model) takes from the training
#: recipe of its preset instead of ``FINETUNE_TRAIN``: a new model needs pretraining's learning rate, not the
#: gentle one that keeps a base's knowledge (``decoderlab.config.recipes.finetune_defaults``)
SCRATCH_FIELDS = ("optimizer", "lr", "min_lr", "muon_lr", "schedule")

#: the lesson's optimizer as ``TrainConfig`` fields: Adam at a constant lr 0.1 (PyTorch's betas, no weight decay,
#: no warm-up, no clipping), what the ``lesson`` template and the statquest preset bring to ``finetune``
LESSON_FINETUNE = {"lr": 0.1, "min_lr": 0.1, "warmup": 0, "grad_clip": 0.0, "weight_decay": 0.0,
                   "betas": (0.9, 0.999)}

#: the ``TrainConfig`` fields ``decoderlab.rl`` sets when no ``train_config`` is given: ``batch_size`` counts
#: prompts per micro-batch (each answered ``RLConfig.group_size`` times); ``eval_every`` is the steps between
#: checkpoints (a run has no validation); a small constant learning rate, as policy-gradient fine-tuning of a
#: chat model uses (nanochat's ``chat_rl``, TRL's ``GRPOConfig``: no decay to speak of)
RL_TRAIN = {"max_steps": 200, "batch_size": 4, "lr": 1e-4, "min_lr": 1e-4, "warmup": 0, "weight_decay": 0.0,
            "grad_clip": 1.0, "eval_every": 50, "log_every": 10}

#: ``decoderlab.finetune``'s share of the conversations held out for evaluation (seeded), and how many of the
#: held-out prompts it answers greedily at the end
FINETUNE_VAL_FRACTION = 0.1
FINETUNE_EVAL_PROMPTS = 100

#: ``decoderlab.train_pairs``' defaults: the lesson's ``L.Trainer(max_epochs=30)``, seed 42, Adam lr 0.1,
#: one pair per batch
PAIR_TRAIN = {"max_epochs": 30, "seed": 42, "lr": 0.1, "batch_size": 1}

# ---------------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------------

#: new tokens a generation asks for when the caller gives no number (``generate``, ``chat``, the CLI)
DEFAULT_MAX_NEW_TOKENS = 200
#: the parameters from which a compiled decode step pays for its compile: below, generate, sample and chat never
#: advise --aot and serve decodes eagerly unless told to compile. Why a million: an eager token costs ~0.5 ms
#: at 8k parameters and ~1.6 ms at baby-shakespeare's 0.8M (1 thread, 2-core EPYC, load 2.8, 2026-12-03), so
#: a 200-token reply takes at most ~0.3 s eagerly and a compiled step (tens of seconds to minutes to compile on a
#: CPU) saves a fraction of that; from ~10M (shakespeare-char: 7.7 ms a token, gpt2: 58 ms) the step's speed-up is
#: seconds a reply (docs/benchmarks.md, bench/generate.py)
COMPILE_PAYS_FROM = 1_000_000
#: the sampling temperature when the caller gives none (1 = the model's own distribution); the lesson's
#: pair-trained models answer greedily instead
DEFAULT_TEMPERATURE = 1.0

# ---------------------------------------------------------------------------------------------------------
# serving
# ---------------------------------------------------------------------------------------------------------

#: the address and port ``decoderlab serve`` listens on (this machine only)
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8000

#: ``ServeLimits``' field defaults (see ``ServeLimits`` for each)
SERVE_LIMITS = dict(max_body_bytes=1_000_000, max_messages=256, max_tokens=4096, default_max_tokens=256, max_n=8,
                    max_stop=4, max_batch=32, max_queue=64, prefill_chunk=None)

#: ``decoderlab serve --prefill-chunk``'s meaning (its default is ``SERVE_LIMITS["prefill_chunk"]``)
SERVE_PREFILL_CHUNK_HELP = ("read a prompt longer than N tokens N tokens per decode step, between the decode steps "
                            "of the rows already running (chunked prefill), >= 1 (default: off, every newcomer's "
                            "prompt read whole in one padded pass: measured faster for bursts, docs/serving.md)")

#: what each limit a command-line flag sets means (``decoderlab serve --max-tokens ...``)
SERVE_LIMIT_HELP = {
    "max_tokens": "most tokens one choice may ask for",
    "max_body_bytes": "largest request body in bytes",
    "max_messages": "most chat messages in a request",
    "max_n": "most choices per request",
    "max_batch": "most rows (choices) decoded together",
    "max_queue": "most requests waiting to join the batch before the server answers 429",
}

#: the defaults of the limits that have a flag
SERVE_LIMIT_DEFAULTS = {name: SERVE_LIMITS[name] for name in SERVE_LIMIT_HELP}

# ---------------------------------------------------------------------------------------------------------
# the glass box
# ---------------------------------------------------------------------------------------------------------

#: ``verify``'s tolerance per step, times max(1, max |value|) of the float64 reference
VERIFY_TOL = 1e-5
#: next-token probabilities ``explain`` shows per position
EXPLAIN_TOP_K = 5

#: ``RLConfig``'s defaults (``decoderlab.config.rl``): G = 8 replies per prompt (TRL ``GRPOTrainer``'s
#: ``num_generations``; nanochat's ``chat_rl`` samples 16), replies of up to 128 tokens sampled at temperature 1,
#: no KL penalty (nanochat), advantages not divided by the group's standard deviation (nanochat, Dr. GRPO)
RL_DEFAULTS = {"group_size": 8, "max_new_tokens": 128, "temperature": 1.0, "top_k": None, "top_p": None,
               "kl_coef": 0.0, "scale_rewards": False}

#: what the ``contains_words`` reward adds to the share of words present when the reply ends its turn (so a
#: reply that uses every word and stops scores 1 + this)
END_OF_TURN_BONUS = 0.2

#: DPO's beta (Rafailov et al. 2023; TRL ``DPOConfig.beta``'s default): the strength of the implicit KL
#: constraint to the reference model
DPO_BETA = 0.1

#: the report card's held-out questions per row (a 95% Wilson interval of at most +-4.9 points at any accuracy:
#: 1.96^2 / (4 * 0.049^2) = 400) and sampled replies per question (pass@1 their mean, pass@8 Chen et al.'s estimate)
REPORT_QUESTIONS = 400
REPORT_SAMPLES = 8
