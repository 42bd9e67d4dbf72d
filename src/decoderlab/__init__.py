"""decoderlab: build, verify, train, inspect and chat with decoder-only (GPT-style) transformers."""

__version__ = "0.1.0"

from .attention import Attention, MultiHeadAttention, SelfAttention
from .checkpoint import load_checkpoint, save_checkpoint
from .data import LESSON_PAIRS, lesson_tokenizer, pair_inputs_and_labels, tokenizer_for_pairs
from .generation import (KVCache, generate, generate_batch, greedy_response, stream, stream_text,
                         TextStreamer)
from .glassbox import Trace, VerifyReport, explain, explain_example, trace, verify
from .model import PRESETS, DecoderBlock, DecoderOnlyTransformer, ModelConfig, preset
from .positions import LearnedPositionEncoding, PositionEncoding, RotaryEmbedding
from .tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordTokenizer, build_tokenizer
from .data import corpus_tokens, embedded_corpus_path, read_corpus, split_tokens
from .data import TokenDataModule
from .training import TrainConfig, TrainSummary, train_lm
from .chat import TEMPLATES, ChatTemplate, chat_reply, render_chat, stream_chat_reply  # issue 10
from .finetune import finetune  # issue 10

__all__ = [
    "Attention", "MultiHeadAttention", "SelfAttention",
    "load_checkpoint", "save_checkpoint",
    "LESSON_PAIRS", "lesson_tokenizer", "pair_inputs_and_labels", "tokenizer_for_pairs",
    "KVCache", "greedy_response", "generate", "generate_batch", "stream", "stream_text", "TextStreamer",
    "Trace", "VerifyReport", "explain", "explain_example", "trace", "verify",
    "PRESETS", "DecoderBlock", "DecoderOnlyTransformer", "ModelConfig", "preset",
    "LearnedPositionEncoding", "PositionEncoding", "RotaryEmbedding",
    "Tokenizer", "WordTokenizer", "CharTokenizer", "BPETokenizer", "build_tokenizer",
    "corpus_tokens", "embedded_corpus_path", "read_corpus", "split_tokens",
    "TokenDataModule", "TrainConfig", "TrainSummary", "train_lm",
    "TEMPLATES", "ChatTemplate", "chat_reply", "render_chat", "stream_chat_reply", "finetune",
]
