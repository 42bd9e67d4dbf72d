"""Generation: logits -> tokens -> text. The KV-cache engine and its sampling, stops and text streaming.

Public API: :func:`generate` / :func:`stream` (one prompt; tokens as a list or yielded as produced),
:func:`generate_batch` (prompts of different lengths, left-padded), :func:`stream_text` / :class:`TextStreamer`
(text pieces that never split a character), :class:`Sampler` (greedy, temperature, top-k, top-p),
:class:`ChatSession` (a conversation's token history). With the cache the tokens are exactly those of the
lesson's loop (``use_cache=False``; the lesson's own ``greedy_response`` is in :mod:`decoderlab.lesson`),
greedy or seeded; see :func:`stream` for the context-window rule past max_len.
"""

from ..attention import KVCache, LayerKVCache
from .engine import default_keep, generate, generate_batch, stream
from .sampling import Sampler, check_sampling
from .stops import StopMatcher
from .text import ChatSession, TextStreamer, stream_text

__all__ = [
    "KVCache", "LayerKVCache", "default_keep", "generate", "generate_batch", "stream", "Sampler",
    "check_sampling", "StopMatcher", "ChatSession", "TextStreamer", "stream_text",
]
