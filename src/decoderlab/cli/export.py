"""``decoderlab export``: a checkpoint as a Hugging Face directory or one GGUF file for llama.cpp and ollama
(``decoderlab.export``)."""

from __future__ import annotations

import argparse

from ..config.names import EXPORT_FORMATS, GGUF_DTYPES
from .options import add_checkpoint_option, check_checkpoint

DESCRIPTION = f"""\
Write a checkpoint in another program's format. What each format carries:

  hf    a Hugging Face directory of the transformers class whose forward equals the model's -- GPT-2 (learned
        positions, LayerNorm, GELU), Llama (rope, RMSNorm, SwiGLU, grouped-query attention), Qwen2 (q/k/v
        biases), Qwen3 (QK-norm), Apertus (rope, QK-norm, ReLU²: the default recipe's) or Arcee (rope, ReLU²)
        -- with config.json, model.safetensors, the tokenizer (any kind) and the chat template; transformers,
        vLLM and llama.cpp's converter read it
  gguf  one GGUF file for llama.cpp and ollama in the llama.cpp architecture that computes the model exactly --
        gpt2 (learned positions, LayerNorm, GELU), llama (rope, RMSNorm, SwiGLU, grouped-query attention),
        qwen2 (q/k/v biases), qwen3 (QK-norm) --, the tokenizer (a BPE or a char vocabulary; a word vocabulary
        is refused) and the chat template inside it, and an ollama Modelfile beside it (OUT without .gguf +
        .Modelfile); --dtype float32, bfloat16, float16, q8_0, q4_0 or q4_1; LoRA adapters merged first; an existing file
        kept unless --force; needs gguf

hf refuses a model no class computes (the lesson's sinusoidal positions, no norm, no MLP), naming the fields
and the nearest class; gguf one no llama.cpp architecture computes (the default recipe's ReLU² MLP with a
query/key norm, --norm layernorm with rope, ...), naming the fields. Nothing is written then."""


def add_export(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_checkpoint_option(p)
    p.add_argument("--out", required=True, metavar="PATH",
                   help="where to write: a directory (hf) or a .gguf file (gguf; its directory must exist)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="gguf", help="the format (default %(default)s)")
    p.add_argument("--dtype", choices=GGUF_DTYPES, default="float32",
                   help="GGUF weight type, named as generate's --dtype: float32, bfloat16, float16, or llama.cpp's "
                        "blocks of 32 weights with a float16 scale -- q8_0 (8-bit), q4_0 (4-bit), q4_1 (4-bit and a "
                        "minimum); norms, biases and positions stay float32 (default %(default)s; hf writes float32)")
    p.add_argument("--name", default=None, help="the model's name in the GGUF file (default: the checkpoint "
                                                "directory's name)")
    p.add_argument("--force", action="store_true", default=False,
                   help="replace an existing --out .gguf file and its Modelfile (default: refuse)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    check_checkpoint(args.checkpoint)
    from ..export import export
    from ..output import quiet_imports

    with quiet_imports():  # transformers (hf) imports torchao, whose CUDA-kernel notices are no error here
        s = export(args.checkpoint, args.out, format=args.format, dtype=args.dtype, name=args.name, force=args.force)
    what = f"{s['format']} {s['dtype']} ({s['architecture']})" if s["format"] == "gguf" else f"hf ({s['architecture']})"
    extra = f", {s['tensors']} tensors" if "tensors" in s else ""
    tok = s["tokenizer"] or "none"
    if s["format"] == "hf":
        tok += ", chat template" if s["chat_template"] else ""
    print(f"wrote {s['out']}: {what}, {s['parameters']:,} parameters, {s['bytes'] / 1e6:.1f} MB{extra}; "
          f"tokenizer: {tok}" + (f"; ollama: {s['modelfile']}" if s.get("modelfile") else ""))
    return 0
