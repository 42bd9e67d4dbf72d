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

Sources: the StatQuest lessons ("Coding Self-Attention in PyTorch", "Coding a ChatGPT Like Transformer From
Scratch in PyTorch"); "Day 27: Self-Attention Explained From Scratch" (A=[1,0], B=[0,1], C=[1,1]);
Vaswani et al. 2017 (scaled dot-product attention, sinusoidal positions); Radford et al. 2019 (GPT-2);
Su et al. 2021 (rotary positions); Zhang & Sennrich 2019 (RMSNorm).
"""

from .examples import EXAMPLES, explain_example
from .explain import explain, explain_trace
from .reference import VerifyReport, VerifyStep, numpy_forward, verify
from .trace import LayerTrace, Trace, trace

__all__ = [
    "LayerTrace", "Trace", "trace",
    "VerifyStep", "VerifyReport", "verify", "numpy_forward",
    "EXAMPLES", "explain_example", "explain", "explain_trace",
]
