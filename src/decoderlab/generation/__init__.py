"""Generation: logits -> tokens -> text. The KV-cache engine and its sampling, stops and text streaming.

Public API: :class:`SamplingParams` (every setting of a generation, checked once, the one object that
travels), :func:`generate` / :func:`stream` (one prompt; tokens as a list or yielded as produced),
:func:`generate_batch` (prompts of different lengths, left-padded, each with its own settings),
:func:`stream_text` / :class:`TextStreamer` (text pieces that never split a character), :class:`Sampler`
(the rows' logits processors, then argmax or one seeded draw), the logits processors of
:mod:`~decoderlab.generation.processors` (penalties, logit bias, suppression, temperature, top-k, top-p,
min-p, the grammar mask of structured output, in a documented order; :class:`Grammar`), :class:`ChatSession` (a conversation's token history). With the cache the
tokens are exactly those of the lesson's loop (``use_cache=False``; the lesson's own ``greedy_response`` is
in :mod:`decoderlab.lesson`), greedy or seeded; see :func:`stream` for the context-window rule past max_len.
"""

from ..attention import KVCache, LayerKVCache
from .engine import default_keep, generate, generate_batch, stream
from .params import BoundParams, SamplingParams, SamplingTypeError, SamplingValueError
from .grammar import Grammar
from .processors import (FrequencyPenalty, GrammarMask, LogitBias, LogitsProcessor, LogitsProcessorList, MinP, PresencePenalty,
                         RepetitionPenalty, SuppressTokens, Temperature, TokenCounts, TopK, TopP)
from .sampling import Sampler
from .stops import StopMatcher
from .text import ChatSession, TextStreamer, stream_text

__all__ = [
    "KVCache", "LayerKVCache", "default_keep", "generate", "generate_batch", "stream", "SamplingParams",
    "BoundParams", "SamplingTypeError", "SamplingValueError", "Sampler", "LogitsProcessor",
    "LogitsProcessorList", "TokenCounts", "RepetitionPenalty", "FrequencyPenalty", "PresencePenalty", "LogitBias",
    "SuppressTokens", "GrammarMask", "Grammar", "Temperature", "TopK", "TopP", "MinP", "StopMatcher", "ChatSession", "TextStreamer",
    "stream_text",
]
