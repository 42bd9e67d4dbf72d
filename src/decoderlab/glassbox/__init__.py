"""The glass box: trace every attention number, recompute it by hand in float64, and explain it.

Three things, in the spirit of the lessons, which print every intermediate matrix and validate it by hand:

- :func:`trace` runs one forward pass of a ``DecoderOnlyTransformer`` and keeps every intermediate (per layer
  and head: queries, keys, values, similarities Q Kᵀ, scaled similarities, the mask, the attention percents
  and the head's output; per layer: the block input, the normalised input, the attention output after the
  output projection, the residual sums and the MLP output; at the end the logits and the top-k next-token
  probabilities) in a :class:`Trace`.
- :func:`verify` recomputes the whole forward pass independently in float64 NumPy from the model's extracted
  weights (the lesson's "we can extract the weights ... and use them to validate the math") and returns a
  :class:`VerifyReport` with the max abs difference at every step.
- :func:`explain` / :func:`explain_example` tell the story step by step as text (and, with ``png``/``html``,
  as heatmaps and a self-contained HTML report; drawing lives in ``decoderlab.glassbox.plotting``).

And what people who study small models do next, on the model's named hook points (:mod:`decoderlab.hooks`):

- :func:`run_with_cache` / :func:`run_with_hooks` (``cache``): every activation by name, or changed on the way;
  ``trace`` is a view over such a cache.
- ``patching``: ablations (zero, mean, resample) of any activation or head, a steering vector, and
  :func:`activation_patching` over layers, positions and heads (raw, or as the fraction of the clean-corrupt
  gap recovered).
- ``attribution``: :func:`logit_lens` (a given token's probability, rank and first layer on top per cell),
  and :func:`decompose` -- a logit split into embeddings, positions, each head, each MLP and the biases,
  adding up exactly.
- ``detectors``: previous-token, duplicate-token and induction scores of every head, composition scores.
- ``watching``: head scores and loss recorded during training (``decoderlab.headwatch.HeadWatch``), read back.
- ``sae`` / ``features`` / ``dashboards``: sparse autoencoders on a hook point (TopK, ReLU + L1; SAELens's files),
  their evaluation (CE loss recovered), features ablated or steered with, and a feature's dashboard
  (training them: ``decoderlab.dictionary.train_sae``).

Sources: the StatQuest lessons ("Coding Self-Attention in PyTorch", "Coding a ChatGPT Like Transformer From
Scratch in PyTorch"); "Day 27: Self-Attention Explained From Scratch" (A=[1,0], B=[0,1], C=[1,1]);
Vaswani et al. 2017 (scaled dot-product attention, sinusoidal positions); Radford et al. 2019 (GPT-2);
Su et al. 2021 (rotary positions); Zhang & Sennrich 2019 (RMSNorm).
"""

from .attribution import (Decomposition, LogitLens, decompose, decompose_names, frozen_final_norm, lens_names,
                          logit_attrs, logit_lens, residual_parts)
from .cache import ActivationCache, act_name, run_with_cache, run_with_hooks
from .detectors import (KINDS, all_head_scores, composition_scores, detection_pattern, head_scores, repeated_tokens,
                        scores_table)
from .examples import EXAMPLES, explain_example
from .features import (SAEEvaluation, evaluate_sae, feature_ablation, feature_dashboard, feature_steering,
                       hook_activations, splice_sae, token_features)
from .explain import explain, explain_trace
from .patching import (activation_patching, logit_difference, mean_ablation, patching_table, recovered_fraction,
                       resample_ablation, steering, zero_ablation)
from .reference import VerifyReport, VerifyStep, numpy_decompose, numpy_forward, numpy_head_results, verify
from .sae import SparseAutoencoder, load_sae
from .trace import LayerTrace, Trace, trace, trace_from_cache

__all__ = [
    "LayerTrace", "Trace", "trace", "trace_from_cache",
    "ActivationCache", "act_name", "run_with_cache", "run_with_hooks",
    "zero_ablation", "mean_ablation", "resample_ablation", "steering", "activation_patching", "logit_difference",
    "patching_table", "recovered_fraction",
    "LogitLens", "logit_lens", "lens_names", "Decomposition", "decompose", "decompose_names", "residual_parts",
    "logit_attrs", "frozen_final_norm",
    "KINDS", "detection_pattern", "head_scores", "all_head_scores", "repeated_tokens", "composition_scores",
    "scores_table",
    "VerifyStep", "VerifyReport", "verify", "numpy_forward", "numpy_head_results", "numpy_decompose",
    "EXAMPLES", "explain_example", "explain", "explain_trace",
    "SparseAutoencoder", "load_sae", "SAEEvaluation", "evaluate_sae", "splice_sae", "hook_activations",
    "feature_ablation", "feature_steering", "feature_dashboard", "token_features",
]
