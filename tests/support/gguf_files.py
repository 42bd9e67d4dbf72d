"""Tiny GGUF files written in the test, as llama.cpp's own converter (convert_hf_to_gguf.py) writes them: a
random ``transformers`` model of the llama / qwen2 / qwen3 / gpt2 family, its tensors under llama.cpp's names
(llama's query and key rows permuted into llama.cpp's interleaved rotary layout, GPT-2's Conv1D weights
transposed), its shape under ``<arch>.*`` and a byte-level BPE tokenizer under ``tokenizer.ggml.*`` -- written
with the ``gguf`` package alone, never downloaded. Matrices take the asked GGML type where their rows allow it
(1-D tensors stay F32, as the converter keeps them); ``k_quant`` writes K-quant blocks that ``gguf`` cannot
write but dequantizes (random 4-bit values under sane float16 scales).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. In 1984, 3 dogs and 12 cats met 2,048 birds! "
               "Don't stop -- we'll see what's next: café, naïve, 東京, emoji 😀.\n\tTabs  and   spaces.\n") * 8


#: the pre-tokenizers of the models' own tokenizer.json files (Hugging Face's form), by llama.cpp's name
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def hf_pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer a model's own tokenizer.json has for llama.cpp's ``pre`` name: GPT-2's
    byte level; SmolLM's digits then byte level; Llama 3's and Qwen2's split regexes then bytes."""
    from tokenizers import Regex, pre_tokenizers

    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    regex = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}[pre]
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def byte_level_bpe(vocab_size: int = 300, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                   pre: str = "gpt-2", texts=None):
    """A ``tokenizers`` byte-level BPE trained on a sample text: specials first (ids 0..), split as the models
    of llama.cpp's pre-tokenizer ``pre`` split (:func:`hf_pre_tokenizer`; Llama 3's skips the merges of a word
    that is a token). ``texts``: the training texts (default: a short sample)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = hf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts or [SAMPLE_TEXT], trainer=trainer)
    return tok


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def hf_model(arch: str, vocab_size: int, seed: int = 0, **overrides):
    """A random tiny ``transformers`` model of ``arch`` (float32, eval mode)."""
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "gpt2":
        # n_positions 1024: transformers reads no n_positions from a GGUF file, so its GPT2Config keeps 1024
        cfg = tf.GPT2Config(**{**dict(vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=1024),
                               **overrides})
        return tf.GPT2LMHeadModel(cfg).eval()
    if arch == "gemma3":
        return _gemma3_model(vocab_size, **overrides)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                  rope_theta=50000.0, tie_word_embeddings=True)
    common.update(overrides)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[arch]
    if arch == "qwen3":  # head_dim != d_model / n_head, and 128: transformers' GGUF loader reads no head_dim for qwen3
        common.update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    model = cls[1](cls[0](**common)).eval()
    with torch.no_grad():  # norms away from 1, so a gain read wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def _gemma3_model(vocab_size: int, **overrides):
    """A tiny Gemma 3 text model as llama.cpp's gemma3 computes it: six layers in its fixed pattern (five sliding,
    window 4, rope base 10,000; one full, base 1,000,000), multi-query heads of 256 (llama.cpp's attention scale
    is 1 / sqrt(head size), transformers' 1 / sqrt(query_pre_attn_scalar) = 256 by default), norms off zero."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(**{**dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=64, sliding_window=4, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0),
        **overrides})
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's norms store weight for a gain of 1 + weight: away from 0, so each matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


_GEMMA3_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of a query / key projection (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GPT2_NAMES = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
               "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def gguf_tensors(arch: str, model) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, as its converter writes them (float32)."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if arch == "gpt2":
            name = name.removeprefix("transformer.")
            if name.endswith(("attn.bias", "masked_bias")) and a.ndim > 1:
                continue
            if name == "lm_head.weight":
                continue  # tied
            parts = name.split(".")
            if parts[0] == "h":
                i, rest = parts[1], ".".join(parts[2:-1])
                if a.ndim == 2:
                    a = a.T.copy()  # Conv1D (in, out) -> (out, in)
                out[f"blk.{i}.{_GPT2_NAMES[rest]}.{parts[-1]}"] = a
            else:
                out[{"wte.weight": "token_embd.weight", "wpe.weight": "position_embd.weight",
                     "ln_f.weight": "output_norm.weight", "ln_f.bias": "output_norm.bias"}[name]] = a
            continue
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = a
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1  # the converter's norm shift: Gemma3RMSNorm computes with 1 + weight
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        else:
            parts = name.split(".")
            i, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if rest.endswith("q_proj") else cfg.num_key_value_heads
                a = llama_permute(a, heads)
            out[f"blk.{i}.{(_GEMMA3_NAMES if arch == 'gemma3' else _LLAMA_NAMES)[rest]}.{kind}"] = a
    return out


def k_quant(gguf, rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    """Random blocks of a K-quant type (bytes, (rows, cols / 256 * type size)) with float16 scales of a sane
    size in each block's first bytes (Q4_K/Q5_K: d, dmin; Q6_K: d last; Q2_K/Q3_K: d last and dmin)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    name = qtype.name
    if name in ("Q4_K", "Q5_K"):
        data[..., 0:4] = scales.reshape(rows, cols // block, 4)
    elif name == "Q6_K":
        data[..., size - 2:] = scales[..., :2]
    else:  # Q2_K: scales then d, dmin at the end; Q3_K: d at the end
        data[..., size - 4:] = scales.reshape(rows, cols // block, 4) if name == "Q2_K" else \
            np.concatenate([data[..., size - 4:size - 2], scales[..., :2]], axis=-1)
    return data.reshape(rows, -1)


def write_gguf(path: str | Path, arch: str, model, tokenizer, *, pre: str = "gpt-2", qtype: str = "F32",
               chat_template: str | None = CHATML, eos: str = "<|im_end|>", bos: str | None = "<|im_start|>",
               extra: dict | None = None, tensors: dict | None = None, types: dict | None = None) -> Path:
    """Write ``model`` (a :func:`hf_model`) and ``tokenizer`` (a ``tokenizers.Tokenizer``) as one GGUF file.

    ``qtype``: the GGML type of the matrices that allow it (rows a multiple of its block; others F16 as the
    converter does; K-quants through :func:`k_quant`, replacing the weights with random blocks). ``extra``:
    more metadata (key -> value, or None to leave a key out: the shape's ``<arch>.*`` keys and the tokenizer's
    ids and flags, ``tokenizer.ggml.bos_token_id``, ``tokenizer.ggml.add_bos_token``, ...); ``tensors`` replaces
    or adds arrays by name; ``types`` forces a GGML type name per tensor."""
    import gguf

    q = gguf.GGMLQuantizationType
    path = Path(path)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    extra = dict(extra or {})
    meta = {**_shape_metadata(arch, cfg), **_special_keys(tokenizer, eos, bos)}
    for key, value in {**meta, **extra}.items():
        if value is None:
            continue
        _add(w, gguf, key, value)
    _add_tokenizer(w, gguf, tokenizer, pre, chat_template)
    arrays = gguf_tensors(arch, model)
    arrays.update(tensors or {})
    for name, a in arrays.items():
        want = (types or {}).get(name)
        t = q[want] if want else (q[qtype] if a.ndim == 2 else q.F32)
        if a.dtype == np.uint8:  # blocks as they are in the file
            w.add_tensor(name, a, raw_dtype=t)
            continue
        block, _ = gguf.GGML_QUANT_SIZES[t]
        if t.name.endswith("_K") and a.ndim == 2 and a.shape[1] % block == 0:
            w.add_tensor(name, k_quant(gguf, *a.shape, t), raw_dtype=t)
            continue
        if a.ndim == 2 and a.shape[1] % block != 0 or t.name.endswith("_K"):
            t = q.F16 if a.ndim == 2 else q.F32
        data = gguf.quants.quantize(a, t) if t not in (q.F32,) else a.astype(np.float32)
        w.add_tensor(name, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_back(path) -> tuple[dict, dict]:
    """A written file read by ``gguf``'s own reader: (tensors by name as (type name, float32 array in our (rows,
    cols) layout), fields by name)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        tensors[t.name] = (t.tensor_type.name, data)
    return tensors, r.fields


def field(fields, name):
    """The value of metadata field ``name`` of :func:`read_back`'s fields (a list for an array)."""
    import gguf

    f = fields[name]
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.contents(i) for i in range(len(f.data))]
    return f.contents()


def _shape_metadata(arch: str, cfg) -> dict:
    if arch == "gpt2":
        return {f"{arch}.context_length": cfg.n_positions, f"{arch}.embedding_length": cfg.n_embd,
                f"{arch}.feed_forward_length": cfg.n_inner or 4 * cfg.n_embd, f"{arch}.block_count": cfg.n_layer,
                f"{arch}.attention.head_count": cfg.n_head,
                f"{arch}.attention.layer_norm_epsilon": float(cfg.layer_norm_epsilon)}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    meta = {f"{arch}.context_length": cfg.max_position_embeddings, f"{arch}.embedding_length": cfg.hidden_size,
            f"{arch}.feed_forward_length": cfg.intermediate_size, f"{arch}.block_count": cfg.num_hidden_layers,
            f"{arch}.attention.head_count": cfg.num_attention_heads,
            f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
            f"{arch}.rope.freq_base": float(cfg.rope_parameters.get("rope_theta", 0.0)
                                            if hasattr(cfg, "rope_parameters") else cfg.rope_theta),
            f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    if arch == "llama":
        meta[f"{arch}.rope.dimension_count"] = head_dim
        meta[f"{arch}.vocab_size"] = cfg.vocab_size
    if arch in ("qwen3", "gemma3"):
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    if arch == "gemma3":  # the full layers' base; llama.cpp fixes the sliding ones' (10,000) and their pattern
        meta[f"{arch}.rope.freq_base"] = float(cfg.rope_parameters["full_attention"]["rope_theta"])
        meta[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    return meta


def _add(w, gguf, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, list(value))


def sentencepiece_vocab(texts, vocab_size: int = 800) -> dict:
    """A SentencePiece-style BPE vocabulary as a GGUF file of Llama 2's holds it: ``<unk>``, ``<s>``, ``</s>``, the
    256 byte tokens ``<0x00>`` .. ``<0xFF>``, then pieces (spaces as ``▁``) scored by their merge order (the first
    learned scores highest). Returns ``{"tokens", "scores", "types"}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {"tokens": tokens, "scores": scores, "types": types}


def gemma_sentencepiece_vocab(texts, vocab_size: int = 800) -> dict:
    """A SentencePiece-style BPE vocabulary laid out as Gemma 3's GGUF file holds it: ``<pad>`` ``<eos>``
    ``<bos>`` ``<unk>`` ``<mask>`` (0 .. 4), ``<start_of_turn>`` ``<end_of_turn>`` (control), the 256 byte tokens,
    then pieces (spaces as ``▁``, none added before a text) scored by their merge order; its ids and flags
    (``ids``): bos 2, eos 1, unk 3, pad 0, bos first, no space prefix."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [-1000.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [3, 3, 3, 2, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    ids = {"tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
           "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_bos_token": True,
           "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_space_prefix": False}
    return {"tokens": tokens, "scores": scores, "types": types, "ids": ids}


def _special_keys(tokenizer, eos, bos) -> dict:
    """The tokenizer's ids and flags as llama.cpp's converter states them: Llama 2's for a SentencePiece
    vocabulary (<unk> <s> </s> = 0 1 2, bos first, a space before the text) unless it states its own (``ids``:
    Gemma's), else ``eos`` / ``bos`` (token texts) and no bos first, as SmolLM2's file."""
    if isinstance(tokenizer, dict) and "ids" in tokenizer:
        return dict(tokenizer["ids"])
    if isinstance(tokenizer, dict):
        return {"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
                "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return {"tokenizer.ggml.eos_token_id": None if eos is None else vocab[eos],
            "tokenizer.ggml.bos_token_id": None if bos is None else vocab[bos], "tokenizer.ggml.add_bos_token": False}


def _add_tokenizer(w, gguf, tokenizer, pre: str, chat_template) -> None:
    import json

    if isinstance(tokenizer, dict):  # a SentencePiece vocabulary (sentencepiece_vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokenizer["tokens"])
        w.add_token_scores(tokenizer["scores"])
        w.add_token_types(tokenizer["types"])
        if chat_template is not None:
            w.add_chat_template(chat_template)
        return

    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL) for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    if chat_template is not None:
        w.add_chat_template(chat_template)


EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n", "\r\n", "\t", " \t\n ", "a", "A", "hello", " hello", "  hello", "hello ",
    "hello  world", "hello\nworld", "hello\n\nworld", "hello \n world", "Hello, World!", "HELLO WORLD",
    "1", "12", "123", "1234", "12345678901234567890", " 42", "3.14159", "1,000,000", "2024-06-01", "$12.50",
    "x=1+2*3", "a1b2c3", "I'm", "you're", "DON'T", "it's", "we'll", "they've", "I'd", "O'Neil's",
    "café", "naïve", "Ünïcödé", "东京", "東京タワー", "안녕하세요", "Привет мир", "مرحبا", "שלום",
    "😀", "👍🏽", "🇫🇷", "e\u0301", "\u00a0non-breaking", "zero\u200bwidth", "tab\there", "a  \n  b",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<|im_start|>user\nHi<|im_end|>",
    "def f(x):\n    return x ** 2\n", "if (a && b) { c++; }", "https://example.com/path?q=1&r=2",
    "email@example.com", "#hashtag @mention", "...", "?!?!", "---", "((()))", "'quoted'", '"double"',
    "trailing spaces   ", "   leading spaces", "mixed\ttabs and  spaces\n", "ALL CAPS AND 123 NUMBERS",
]


def sample_strings(shared_dir, n: int = 200, seed: int = 0) -> list[str]:
    """``n`` strings for tokenizer comparisons: :data:`EDGE_CASES` (whitespace, digits, contractions, scripts,
    emoji, text that looks like control tokens, code), then slices of ../shared/data's Shakespeare, GSM8K
    questions and Self-Instruct instructions (seeded)."""
    import json
    import random

    rng = random.Random(seed)
    data = Path(shared_dir) / "data"
    shakespeare = (data / "tinyshakespeare.txt").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in (data / "gsm8k_train.jsonl").read_text(encoding="utf-8").splitlines()[:400]]
    seeds = [json.loads(line) for line in
             (data / "self_instruct_seed_tasks.jsonl").read_text(encoding="utf-8").splitlines()]
    out = list(EDGE_CASES)
    while len(out) < n:
        kind = len(out) % 3
        if kind == 0:
            start = rng.randrange(len(shakespeare) - 400)
            out.append(shakespeare[start:start + rng.randrange(20, 400)])
        elif kind == 1:
            row = rng.choice(rows)
            out.append(row["question"] + ("\n" + row["answer"] if rng.random() < 0.5 else ""))
        else:
            out.append(rng.choice(seeds)["instruction"])
    return out[:n]
