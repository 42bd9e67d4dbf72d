"""The names of the choices decoderlab offers, as plain data (no torch): each is the one list the library
checks against and the command line offers (``--position``, ``--norm``, ``--tokenizer``, ``--dtype`` ...)."""

from __future__ import annotations

#: position encodings (``ModelConfig.position``; ``decoderlab.positions`` builds them)
POSITIONS = ("sinusoidal", "learned", "rope", "none")
#: norms (``ModelConfig.norm``): the lesson has none; GPT-2 LayerNorm (Ba et al. 2016); RMSNorm (Zhang &
#: Sennrich 2019)
NORMS = ("none", "layernorm", "rmsnorm")
#: MLP sublayers (``ModelConfig.mlp``): none (the lesson), GELU (GPT-2), ReLU² (So et al. 2021, "Primer"), SwiGLU
#: (the gated MLP of Llama, Shazeer 2020), GeGLU (the same gate through GELU's tanh approximation: Gemma's)
MLPS = ("none", "gelu", "relu2", "swiglu", "geglu")
#: what attention a layer runs (``ModelConfig.layer_types``, transformers' ``layer_types``): every earlier position,
#: or the last ``sliding_window`` positions only
LAYER_TYPES = ("full_attention", "sliding_attention")
#: rotary layouts (``ModelConfig.rope_layout``): RoFormer's interleaved pairs (x[2i], x[2i+1]), or Hugging Face's
#: Llama family's halves (x[i], x[i + d_head/2])
ROPE_LAYOUTS = ("interleaved", "rotate_half")
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
TEMPLATES = ("decoderlab", "lesson", "tools")
DEFAULT_TEMPLATE = "decoderlab"

#: GGUF's block-quantized weight types that decoderlab keeps and multiplies as they are (``decoderlab.quant`` over
#: ``decoderlab.kernels``, whose ``WEIGHT_BLOCK_TYPES`` these are): blocks of 32 weights with a float16 scale --
#: int8 (q8_0), 4- or 5-bit with an offset (q4_0, q5_0) or a float16 minimum (q4_1, q5_1) -- and llama.cpp's
#: K-quants, blocks of 256 with 6- or 8-bit sub-block scales (q4_k, q5_k, q6_k)
BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
#: the block types a float matrix can be quantized to (llama.cpp's reference quantizers, as ``gguf.quants`` has
#: them); the K-quants are only read from files (llama.cpp's ``llama-quantize`` writes them)
QUANTIZABLE_BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
#: inference dtypes (``decoderlab.dtypes``): float weights, or GGUF's blocks
DTYPES = ("float32", "bfloat16", "float16", *BLOCK_DTYPES)
#: ``--dtype auto``: a GGUF file's weights in their own types (its blocks kept, its float matrices as float32);
#: any other checkpoint's as stored (float32)
AUTO_DTYPE = "auto"

#: training precisions (``TrainConfig.precision``): "auto" picks one for the machine (bf16-mixed on a CUDA GPU
#: with bfloat16, 16-mixed with a gradient scaler on older GPUs, 32 on the CPU and Apple MPS; see
#: ``decoderlab.training.precision``); 32 = float32; the mixed ones autocast to bfloat16 / float16 with float32
#: weights and optimizer state
PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")
#: each precision name -> the name Lightning's ``Trainer(precision=...)`` uses ("auto" is resolved first)
PRECISION_ALIASES = {"auto": "auto", "32": "32-true", "32-true": "32-true", "bf16-mixed": "bf16-mixed",
                     "16-mixed": "16-mixed"}
#: the training strategies decoderlab builds itself (others go to Lightning by name): "fsdp" is FSDP2 with
#: one unit per decoder block and float32 gradient reduction (``decoderlab.training.strategy``)
OWN_STRATEGIES = ("fsdp",)

#: optimizers and learning-rate schedules (``TrainConfig.optimizer`` / ``.schedule``; ``decoderlab.training.optim``)
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")

#: the worked examples of ``decoderlab explain --example NAME`` (``decoderlab.glassbox.EXAMPLES`` maps them to
#: their functions)
EXAMPLES = ("self-attention-101", "statquest-self-attention", "position-encoding")

#: where inference runs (``--device``; :func:`decoderlab.devices.resolve_device`): auto = a CUDA GPU, else Apple
#: MPS, else the CPU; cuda = the current CUDA GPU; cuda:N = GPU number N
DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
DEFAULT_DEVICE = "auto"
#: what ``decoderlab patch --over`` patches (``decoderlab.glassbox.activation_patching``'s ``over``: its
#: ``PATCH_OVER`` maps them to hook points) and the tables' axes (``by``; "attn_head" is by head)
PATCH_POINTS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head")
PATCH_AXES = ("layer", "layer,pos", "layer,head", "layer,pos,head")
#: the head detectors (``decoderlab.glassbox.KINDS``)
HEAD_DETECTORS = ("previous_token", "duplicate_token", "induction")

#: the fine-tuning methods (``decoderlab finetune --method``): supervised on conversations, DPO on preference pairs
FINETUNE_METHODS = ("sft", "dpo")

#: the built-in rewards of reinforcement learning (``decoderlab.reinforcement.rewards.BUILTIN_REWARDS`` maps them to
#: functions); any other reward is given as ``module:function``
REWARDS = ("contains_words", "exact", "regex", "number", "countdown")
DEFAULT_REWARD = "contains_words"

#: LoRA target groups -> the model's ``nn.Linear`` names inside each decoder block
LORA_TARGETS = {"attn": ("attention.qkv", "attention.proj"), "mlp": ("mlp.fc", "mlp.gate", "mlp.proj")}
DEFAULT_LORA_TARGETS = ("attn", "mlp")

#: export formats (``decoderlab export --format``): a Hugging Face directory, or one GGUF file for
#: llama.cpp and ollama (llama.cpp's ``gpt2`` architecture)
EXPORT_FORMATS = ("hf", "gguf")
#: GGUF weight types, spelled as ``DTYPES`` (one vocabulary for every --dtype): float32, bfloat16, float16, and llama.cpp's blocks of 32 weights with a float16 scale (``BLOCK_DTYPES``:
#: 8-bit q8_0, 4-bit q4_0, 4-bit with a float16 minimum q4_1)
GGUF_DTYPES = ("float32", "bfloat16", "float16", "q8_0", "q4_0", "q4_1")
#: the model shape both formats carry, GPT-2's: (ModelConfig field, the value it must have, the train option
#: that sets it or None, why). ``decoderlab.export.to_gguf`` refuses any other.
GPT2_SHAPE = (
    ("position", "learned", "--position", "GPT-2 has learned absolute positions (wpe)"),
    ("norm", "layernorm", "--norm", "GPT-2 uses pre-LayerNorm"),
    ("mlp", "gelu", "--mlp", "GPT-2 blocks have a GELU MLP"),
    ("attn_out_proj", True, None, "GPT-2 attention has an output projection (c_proj)"),
    ("lm_head_bias", False, None, "GPT-2's lm_head has no bias"),
    ("qk_norm", False, None, "GPT-2 has no query/key norm"),
    ("n_kv_head", 0, None, "GPT-2 has a key/value head per query head (n_kv_head 0 = n_head)"),
    ("head_dim", 0, None, "GPT-2's heads split d_model (head_dim 0 = d_model // n_head)"),
    ("qkv_bias", False, None, "GPT-2's biases are all or none (bias)"),
    ("sandwich_norm", False, None, "GPT-2 has no norms after attention and the MLP"),
    ("embed_scale", False, None, "GPT-2 does not scale its embeddings"),
    ("sliding_window", 0, None, "GPT-2 attends to every earlier position"),
    ("query_pre_attn_scalar", 0, None, "GPT-2 scales attention scores by 1 / sqrt(d_head)"),
)
