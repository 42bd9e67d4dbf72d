"""``decoderlab export``: a checkpoint as a Hugging Face GPT-2 directory or one GGUF file for llama.cpp and
ollama (``decoderlab.export``)."""

from __future__ import annotations

import argparse

from ..config.names import EXPORT_FORMATS, GGUF_DTYPES, GPT2_SHAPE

SHAPE_TEXT = ", ".join(f"{field}={value!r}" for field, value, _, _ in GPT2_SHAPE)
DESCRIPTION = f"""\
Write a checkpoint in another program's format. What each format carries:

  hf    a Hugging Face GPT-2 directory (config.json, model.safetensors; GPT-2's tokenizer files with a
        byte-level BPE, the weights alone with a char or word vocabulary); needs transformers
  gguf  one GGUF file for llama.cpp and ollama (llama.cpp's gpt2 architecture), the tokenizer inside it
        (a BPE or a char vocabulary; a word vocabulary is refused); --dtype f32, f16, q8_0, q4_0 or q4_1;
        needs gguf

Both carry GPT-2's shape only: {SHAPE_TEXT}
(learned positions, LayerNorm, a GELU MLP). Another shape (--position rope, --norm rmsnorm, --mlp relu2, a
recipe's query/key norm) is refused before anything is written, naming the option."""


def add_export(p) -> None:
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("run_dir", metavar="RUN_DIR", help="a decoderlab checkpoint (a run directory) or a GPT-2 directory")
    p.add_argument("out", metavar="OUT", help="where to write: a directory (hf) or a .gguf file (gguf)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="gguf", help="the format (default %(default)s)")
    p.add_argument("--dtype", choices=GGUF_DTYPES, default="f32",
                   help="GGUF weight type: f32, f16, or llama.cpp's blocks of 32 weights with a float16 scale -- "
                        "q8_0 (8-bit), q4_0 (4-bit), q4_1 (4-bit and a minimum); norms, biases and positions stay f32 "
                        "(default %(default)s; hf writes f32)")
    p.add_argument("--name", default=None, help="the model's name in the GGUF file (default: RUN_DIR's name)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from ..export import export
    from ..output import quiet_imports

    with quiet_imports():  # transformers (hf) imports torchao, whose CUDA-kernel notices are no error here
        s = export(args.run_dir, args.out, format=args.format, dtype=args.dtype, name=args.name)
    what = f"{s['format']} {s['dtype']}" if s["format"] == "gguf" else "hf (GPT-2 directory)"
    extra = f", {s['tensors']} tensors" if "tensors" in s else ""
    tok = s["tokenizer"] or "none"
    if s["format"] == "hf" and not s["tokenizer_written"]:
        tok += " (not written: GPT-2's tokenizer files hold a byte-level BPE)"
    print(f"wrote {s['out']}: {what}, {s['parameters']:,} parameters, {s['bytes'] / 1e6:.1f} MB{extra}; "
          f"tokenizer: {tok}")
    return 0
