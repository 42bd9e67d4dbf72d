"""decoderlab: build, verify, train, inspect and chat with decoder-only (GPT-style) transformers.

``import decoderlab`` is light: the names below are loaded on first use (PEP 562), so the command line,
loading a checkpoint and generating never import Lightning, matplotlib or transformers.
"""

from __future__ import annotations

import importlib

from ._version import __version__

#: public name -> the module that defines it
_EXPORTS = {
    "load": "api", "Model": "api",
    "Attention": "lesson", "SelfAttention": "lesson", "LESSON_PAIRS": "lesson", "lesson_tokenizer": "lesson",
    "pair_inputs_and_labels": "lesson", "tokenizer_for_pairs": "lesson", "greedy_response": "lesson",
    "MultiHeadAttention": "attention", "KVCache": "attention",
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "generate": "generation", "generate_batch": "generation", "stream": "generation", "stream_text": "generation",
    "TextStreamer": "generation", "SamplingParams": "generation",
    "Trace": "glassbox", "VerifyReport": "glassbox", "explain": "glassbox", "explain_example": "glassbox",
    "trace": "glassbox", "verify": "glassbox", "run_with_cache": "glassbox", "run_with_hooks": "glassbox",
    "hook_names": "hooks", "use_hooks": "hooks",
    "PRESETS": "model", "DecoderBlock": "model", "DecoderOnlyTransformer": "model", "ModelConfig": "model",
    "preset": "model",
    "LearnedPositionEncoding": "positions", "PositionEncoding": "positions", "RotaryEmbedding": "positions",
    "Tokenizer": "tokenizers", "WordTokenizer": "tokenizers", "CharTokenizer": "tokenizers",
    "BPETokenizer": "tokenizers", "build_tokenizer": "tokenizers",
    "corpus_tokens": "data", "embedded_corpus_path": "data", "read_corpus": "data", "split_tokens": "data",
    "TokenDataModule": "training", "TrainConfig": "training", "TrainSummary": "training", "train_lm": "training",
    "train_pairs": "training",
    "TEMPLATES": "chat", "ChatTemplate": "chat", "JinjaChatTemplate": "chat", "chat_reply": "chat", "render_chat": "chat",
    "stream_chat_reply": "chat", "load_model": "chat", "load_conversations": "chat",
    "finetune": "finetuning", "rl": "reinforcement",
}
_SUBMODULES = ("attention", "checkpoint", "data", "files", "generation", "glassbox", "hf", "gguf", "hooks", "lesson",
               "model", "positions", "threads", "tokenizers", "training", "chat", "finetuning", "tinystories",
               "headwatch", "cli", "reinforcement", "lora", "jsonl", "api", "export")

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # next time a plain attribute
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'decoderlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
