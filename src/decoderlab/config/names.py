"""The names of the choices decoderlab offers, as plain data (no torch): each is the one list the library
checks against and the command line offers (``--position``, ``--norm``, ``--tokenizer``, ``--dtype`` ...)."""

from __future__ import annotations

#: position encodings (``ModelConfig.position``; ``decoderlab.positions`` builds them)
POSITIONS = ("sinusoidal", "learned", "rope", "none")
#: norms (``ModelConfig.norm``): the lesson has none; GPT-2 LayerNorm (Ba et al. 2016); RMSNorm (Zhang &
#: Sennrich 2019)
NORMS = ("none", "layernorm", "rmsnorm")
#: MLP sublayers (``ModelConfig.mlp``): none (the lesson), GELU (GPT-2), ReLU² (So et al. 2021, "Primer")
MLPS = ("none", "gelu", "relu2")
#: weight initialisations (``ModelConfig.init``)
INITS = ("default", "gpt2")
#: attention kernels (``ModelConfig.attention``): PyTorch's scaled_dot_product_attention, or every number
#: written out (the one the glass box records)
KERNELS = ("sdpa", "explicit")

#: tokenizer kinds (``decoderlab.tokenizers.TOKENIZERS`` maps them to classes)
TOKENIZERS = ("word", "char", "bpe")
DEFAULT_TOKENIZER = "char"
DEFAULT_BPE_VOCAB_SIZE = 1024

#: chat templates (``decoderlab.chat.TEMPLATES`` maps them to templates)
TEMPLATES = ("decoderlab", "lesson")
DEFAULT_TEMPLATE = "decoderlab"

#: inference dtypes (``decoderlab.dtypes``; int8 is weight-only quantization through torchao)
DTYPES = ("float32", "bfloat16", "float16", "int8")

#: training precisions (``TrainConfig.precision``) and the names Lightning's ``Trainer(precision=...)`` uses
PRECISIONS = ("32", "bf16-mixed")
PRECISION_ALIASES = {"32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed"}

#: optimizers and learning-rate schedules (``TrainConfig.optimizer`` / ``.schedule``; ``decoderlab.training.optim``)
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")

#: the worked examples of ``decoderlab explain --example NAME`` (``decoderlab.glassbox.EXAMPLES`` maps them to
#: their functions)
EXAMPLES = ("self-attention-101", "statquest-self-attention", "position-encoding")
