"""Tiny random models of every class decoderlab reads, and tokenizers built the way each family's are, for the
tests of decoderlab.hf: everything is made here (random weights, tokenizers trained on a few lines), nothing is
downloaded."""

from __future__ import annotations

import json
import random

import torch
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
          "the slings and arrows of outrageous fortune, 1234 5678 90 -- 3.14159, 2,718!",
          "déjà vu, naïve café; Größe; 東京 and 北京; emoji 😀 🎉; tabs\tand\nnew lines   spaced"] * 20


def strings(specials: list[str], n: int = 200) -> list[str]:
    """``n`` test strings: fixed edge cases, then seeded mixtures of words, digits, unicode, runs of spaces and
    the tokenizer's special tokens (alone, glued to words, spaced)."""
    fixed = ["", " ", "  ", "\n", "hello", " hello", "hello ", "12345", "3.14159", "1,000,000", "x=-1",
             "東京", "😀😀", "naïve café", "a\tb\nc", "   leading", "trailing   ", "Ĳ ǅ ﬁ", "\u00a0nbsp", "é" * 7]
    pieces = ["to", "be", " the", "question", "007", "2024", "   ", "\n", "\t", "ünï", "东京", "🎉", "!", "--",
              "'tis", " 42", "Größe", *specials, *(f" {s} " for s in specials)]
    rng = random.Random(0)
    out = list(fixed)
    while len(out) < n:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))))
    return out[:n]


def train_bpe(pre, decoder, alphabet=None, special=("<|endoftext|>",)):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre, decoder
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(special), show_progress=False,
                                  initial_alphabet=alphabet or [])
    hf.train_from_iterator(CORPUS, trainer=trainer)
    data = json.loads(hf.to_str())
    return data["model"]["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                                    for m in data["model"]["merges"]]


def byte_level():
    return train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                     pre_tokenizers.ByteLevel.alphabet())


def gpt2_tokenizer():
    vocab, merges = byte_level()
    return transformers.GPT2Tokenizer(vocab=vocab, merges=merges)


def qwen2_tokenizer():
    vocab, merges = byte_level()
    tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def llama_tokenizer():
    """SentencePiece's BPE (Llama 2, TinyLlama): word starts as "\u2581", the 256 byte-fallback tokens, <s>."""
    vocab, merges = train_bpe(pre_tokenizers.Metaspace(), decoders.Metaspace(), special=())
    full = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(vocab, key=vocab.get):
        full.setdefault(token, len(full))
    return transformers.LlamaTokenizer(vocab=full, merges=merges, add_bos_token=True)


#: Gemma's control tokens, first in its vocabulary (pad, eos, bos, unk, mask), then its chat turns'
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]


def gemma_vocab() -> tuple[dict, list]:
    """A tiny SentencePiece-style BPE as Gemma's is laid out: the control tokens, the 256 byte-fallback tokens
    ``<0x00>`` .., then pieces trained on :data:`CORPUS` with spaces as "▁" (no space before the text)."""
    vocab, merges = train_bpe(pre_tokenizers.Metaspace(prepend_scheme="never"), decoders.Metaspace(), special=())
    full = {t: i for i, t in enumerate(GEMMA_SPECIALS)}
    full.update({f"<0x{b:02X}>": len(GEMMA_SPECIALS) + b for b in range(256)})
    for token in sorted(vocab, key=vocab.get):
        full.setdefault(token, len(full))
    return full, merges


def gemma_tokenizer():
    """Gemma 3's tokenizer class (``GemmaTokenizer``: BPE with byte fallback, spaces as "▁", <bos> first) over
    :func:`gemma_vocab`, its turn tokens special."""
    vocab, merges = gemma_vocab()
    tok = transformers.GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def llama3_tokenizer():
    """Llama 3's: a byte-level BPE whose post-processor template puts <|begin_of_text|> first (no add_bos_token)."""
    vocab, merges = byte_level()
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    hf.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    hf.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))])])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=hf, bos_token="<|begin_of_text|>",
                                                eos_token="<|eot_id|>")


_SIZE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}

#: name -> (config class, model class, config fields, tokenizer): one tiny model of each class decoderlab reads
#: (GQA everywhere; the biases, gains, head sizes and tying each family has, all made to matter)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_SIZE, **_ROPE), llama_tokenizer),
    "llama-mqa-bias-tied": ("LlamaConfig", "LlamaForCausalLM",
                            dict(_SIZE, num_key_value_heads=1, attention_bias=True, mlp_bias=True, head_dim=32,
                                 tie_word_embeddings=True), llama3_tokenizer),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_SIZE, sliding_window=None), llama_tokenizer),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SIZE, tie_word_embeddings=True), qwen2_tokenizer),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_SIZE, head_dim=24, attention_bias=True), qwen2_tokenizer),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(_SIZE, hidden_act="relu2", **_ROPE), llama3_tokenizer),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(_SIZE, mlp_bias=True, **_ROPE), llama3_tokenizer),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64), gpt2_tokenizer),
    # sliding windows shorter than the prompt and its 20 new tokens: every layer (Mistral), the last one (Qwen2)
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(_SIZE, sliding_window=5), llama_tokenizer),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(_SIZE, use_sliding_window=True, sliding_window=6,
                                                          max_window_layers=1), qwen2_tokenizer),
    # Gemma 3: two sliding layers (window 4, rope base 100) then a full one (base 10,000), multi-query heads of 32
    # (4 x 32 != 64), query_pre_attn_scalar 24, norms after attention and the MLP, GeGLU, a scaled embedding
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_SIZE, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=4,
                    query_pre_attn_scalar=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
               gemma_tokenizer),
}


def tiny_model(name: str, vocab_size: int, seed: int = 0, **overrides):
    """A random ``transformers`` model of ``CLASSES[name]`` in eval mode, its norms' gains and its biases moved
    off their 1 / 0 start (so that every tensor matters) and its special ids cleared."""
    config_class, model_class, fields, _ = CLASSES[name]
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **{**fields, **overrides},
                                                 bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln_" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def hf_directory(path, name: str, spare_rows: int = 5, seed: int = 0, **overrides):
    """A Hugging Face directory of a tiny ``name`` model with its family's tokenizer (the embedding ``spare_rows``
    larger than the vocabulary, as Qwen's is): ``(the transformers model, the AutoTokenizer)``."""
    tok = CLASSES[name][3]()
    model = tiny_model(name, len(tok) + spare_rows, seed, **overrides)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, transformers.AutoTokenizer.from_pretrained(path)


#: Llama 2 chat's template (meta-llama/Llama-2-7b-chat-hf): the template writes the start token itself, before
#: each user turn
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")


def chat_directory(path, name: str, template: str, specials=(), seed: int = 0):
    """``hf_directory`` of ``name`` with the Jinja chat ``template`` in its tokenizer files, and ``specials``
    added to the tokenizer as special tokens (in the embedding's spare rows): ``(the transformers model, the
    AutoTokenizer)``."""
    model, auto = hf_directory(path, name, seed=seed)
    if specials:
        auto.add_special_tokens({"additional_special_tokens": list(specials)})
    auto.chat_template = template
    auto.save_pretrained(path)
    return model, transformers.AutoTokenizer.from_pretrained(path)


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of a ``transformers`` model after ``ids`` (no cache, no stop: the reference)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]
