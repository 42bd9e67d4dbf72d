"""A chat checkpoint a tiny model can improve by reinforcement learning in seconds: "reply with the letter the
prompt names" (the built-in regex reward, pattern ``^<letter>``), shared by the tests of ``rl`` and its command."""

import json

import torch

from decoderlab.chat import TEMPLATES, add_chat_tokens
from decoderlab.checkpoint import CHAT_TEMPLATE_KEY, save_checkpoint
from decoderlab.model import DecoderOnlyTransformer, preset
from decoderlab.tokenizers import CharTokenizer

LETTERS = "abcd"


def letter_checkpoint(directory, template: bool = True, seed: int = 0):
    """A one-block chat model on the letters, saved in ``directory`` (without a chat template: a base model)."""
    torch.manual_seed(seed)
    tok = CharTokenizer.from_text(LETTERS)
    model = DecoderOnlyTransformer(preset("baby-shakespeare", num_tokens=tok.vocab_size, d_model=32, n_layer=1,
                                          n_head=2, max_len=16))
    model, tok, _ = add_chat_tokens(model, tok, "decoderlab")
    meta = {"task": "chat", CHAT_TEMPLATE_KEY: TEMPLATES["decoderlab"].to_dict()} if template else {}
    save_checkpoint(directory, model, tok, meta=meta)
    return directory


def letter_prompts(path, rows=None):
    """The prompts file: one row per letter with the regex reward's ``pattern``."""
    rows = rows if rows is not None else [{"prompt": c, "pattern": f"^{c}"} for c in LETTERS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
