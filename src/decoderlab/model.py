"""The decoder-only transformer: ``ModelConfig``, named presets, ``DecoderBlock`` and ``DecoderOnlyTransformer``.

One class spans the StatQuest lesson's 37-parameter model (d_model 2, one head, no norm, no MLP), GPT-2
small (124,439,808 parameters), the Llama family (grouped-query attention, SwiGLU, rotate-half rope: SmolLM2,
Llama, Qwen2/Qwen3, Mistral; the ``smollm2-135m`` preset is SmolLM2-135M's shape) and Gemma 3 (sliding-window and
full layers with a rope base each, norms before and after attention and the MLP, GeGLU, a scaled embedding: the
options ``sliding_window``, ``layer_types``, ``rope_local_theta``, ``sandwich_norm``, ``embed_scale``,
``query_pre_attn_scalar``). Data flow, read top to bottom in ``DecoderOnlyTransformer.forward``:

    token ids (B, T) -> word embedding ``we`` (B, T, d_model) (x sqrt(d_model) with embed_scale) -> + positions ``pe``
    -> n_layer x DecoderBlock:  x = x + attention(norm_1(x));  x = x + mlp(norm_2(x))   (sandwich_norm: each
                                sublayer's output normed again, norm_1_post / norm_2_post, before it is added)
    -> final norm ``norm_f`` -> fully connected layer ``fc_layer`` -> logits (B, T, num_tokens)

Sources: the StatQuest lesson (decoder-only transformer in PyTorch + Lightning); Radford et al. 2019 (GPT-2,
pre-LayerNorm blocks, initialisation scaled by 1/sqrt(2 n_layer)); Touvron et al. 2023 (Llama: RMSNorm, SwiGLU,
rotary positions) and Ainslie et al. 2023 (grouped-query attention), as Hugging Face's ``LlamaForCausalLM``;
Gemma Team 2025 ("Gemma 3 Technical Report"), as ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fastdecode
from .attention import MultiHeadAttention
from .config.model import PRESETS, ModelConfig, preset
from .config.names import INITS, MLPS, NORMS
from .matvec import linear
from .positions import LearnedPositionEncoding, PositionEncoding, RotaryEmbedding, check_positions
from .quant import (FAST_CONTRACT, BlockEmbedding, BlockLinear, block_dtype, block_weights, grown_rows,
                    is_block_layer, tie_block_weights)

# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def initialisers_skipped():
    """``torch.nn.init``'s initialisers as no-ops while a model whose every weight is then replaced is built on
    the CPU (as transformers' ``no_init_weights``; the GGUF loader's, LoRA's merge): its parameters are allocated,
    never filled. Not the meta device: the first op there imports torch._dynamo (4-6 s on a loaded 2-core
    machine), which nothing else of loading or generating needs."""
    import torch.nn.init as init

    saved = {name: getattr(init, name) for name in dir(init) if name.endswith("_") and not name.startswith("_")}
    try:
        for name in saved:
            setattr(init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight. Shape (..., d)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def hooked_norm(norm: nn.Module, x: torch.Tensor, hooks, point: str) -> torch.Tensor:
    """``norm(x)`` with its hook points (TransformerLens's): ``{point}.hook_scale`` (B, T, 1) =
    sqrt(mean((x - mean x)^2) + eps) (no centring for RMSNorm) and ``{point}.hook_normalized`` (B, T, d_model) =
    (x - mean x) / scale, before the gain and bias. Hooks that only look leave the norm's own kernel to run,
    so recording changes no number; a replaced scale or normalized input (one frozen from another run) gets
    the norm written out from it. No hook points without a norm."""
    if isinstance(norm, nn.Identity):
        return x
    want_normalized = hooks.wants(point + ".hook_normalized")
    if not (want_normalized or hooks.wants(point + ".hook_scale")):
        return norm(x)
    centred = x - x.mean(-1, keepdim=True) if isinstance(norm, nn.LayerNorm) else x
    scale = centred.pow(2).mean(-1, keepdim=True).add_(norm.eps).sqrt_()
    new_scale = hooks(point + ".hook_scale", scale)
    normalized = new_normalized = None
    if want_normalized or new_scale is not scale:
        normalized = centred / new_scale
        new_normalized = hooks(point + ".hook_normalized", normalized)
    if new_scale is scale and new_normalized is normalized:
        return norm(x)
    y = new_normalized * norm.weight
    return y + norm.bias if getattr(norm, "bias", None) is not None else y


def embed_scale(d_model: int, like: torch.Tensor) -> torch.Tensor:
    """sqrt(d_model) as a 0-dim tensor of ``like``'s dtype and device (Gemma's embedding scale): float32 first,
    then rounded to the dtype, as transformers makes it (25.298 becomes 25.25 in bfloat16), so that the product
    is transformers' in every dtype."""
    return torch.tensor(math.sqrt(d_model), dtype=torch.float32, device=like.device).to(like.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The norm the config asks for, over the last dimension (d_model): LayerNorm (Ba et al. 2016), RMSNorm,
    or an identity for norm='none' (the lesson)."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.Identity()


class MLP(nn.Module):
    """The fully connected sublayer, (..., d_model) -> (..., d_model): ``proj(act(fc(x)))`` with GELU (tanh
    approximation) or relu(x)^2 (mlp="relu2"); for mlp="swiglu" the gated ``proj(silu(gate(x)) * fc(x))``
    (Llama's down(silu(gate(x)) * up(x)): ``fc`` is the up projection), for mlp="geglu" the same gate through
    GELU's tanh approximation (Gemma's); then dropout.

    Hook points (TransformerLens's, (B, T, d_ff)): ``hook_pre`` the activation's input (the gate's output for
    a gated MLP), ``hook_pre_linear`` the up projection (gated only), ``hook_post`` what ``proj`` reads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff_size, bias=cfg.bias)
        gated = cfg.mlp in ("swiglu", "geglu")
        self.gate = nn.Linear(cfg.d_model, cfg.ff_size, bias=cfg.bias) if gated else None
        self.gelu_gate = cfg.mlp == "geglu"
        self.proj = nn.Linear(cfg.ff_size, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.mlp == "relu2"
        self.hooks = None  # hook points (B, T, d_ff) when decoderlab.hooks installs them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(self.fc, x)
        hooks = self.hooks
        if self.gate is not None:
            g = linear(self.gate, x)
            if hooks is not None:
                g, h = hooks("hook_pre", g), hooks("hook_pre_linear", h)
            a = (F.gelu(g, approximate="tanh") if self.gelu_gate else F.silu(g)) * h
        else:
            if hooks is not None:
                h = hooks("hook_pre", h)
            a = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        if hooks is not None:
            a = hooks("hook_post", a)
        y = linear(self.proj, a)
        return self.dropout(y) if self.training and self.dropout.p else y


class DecoderBlock(nn.Module):
    """One decoder block: x = x + attention(norm_1(x)); x = x + mlp(norm_2(x)) (pre-norm; no MLP if mlp='none');
    with ``sandwich_norm`` x = x + norm_1_post(attention(norm_1(x))) and x = x + norm_2_post(mlp(norm_2(x)))
    (Gemma 2/3's norms before and after).

    With norm='none' and mlp='none' this is the lesson's "masked self-attention -> residual connection".
    ``layer``: its index, which gives its sliding window (``cfg.window_of``) and its rotary base (``rope``, the
    embedding of its layer kind). Shapes: (B, T, d_model) -> (B, T, d_model). Hook points (TransformerLens's
    names, all (B, T, d_model) but the scales (B, T, 1); :mod:`decoderlab.hooks`): ``hook_resid_pre``,
    ``ln1.hook_scale`` / ``ln1.hook_normalized``, ``ln1_post.*`` (sandwich), ``hook_attn_out`` (after
    ``norm_1_post``: what the residual stream adds), ``hook_resid_mid`` (with an MLP), ``ln2.*``, ``ln2_post.*``,
    ``hook_mlp_out``, ``hook_resid_post``. ``self.hooks`` is None unless the glass box installed some.
    """

    def __init__(self, cfg: ModelConfig, rope: nn.Module | None = None, layer: int = 0):
        super().__init__()
        self.norm_1 = make_norm(cfg)
        self.attention = MultiHeadAttention(
            cfg.d_model, cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim, bias=cfg.bias,
            qkv_bias=cfg.qkv_bias, dropout=cfg.dropout, kernel=cfg.attention, out_proj=cfg.attn_out_proj, rope=rope,
            qk_norm=cfg.qk_norm, qk_norm_eps=cfg.norm_eps, qk_norm_gain=cfg.qk_norm_gain,
            sliding_window=cfg.window_of(layer), scale=cfg.attn_scale if cfg.query_pre_attn_scalar else None,
        )
        self.norm_1_post = make_norm(cfg) if cfg.sandwich_norm else None
        self.has_mlp = cfg.mlp != "none"
        if self.has_mlp:
            self.norm_2 = make_norm(cfg)
            self.mlp = MLP(cfg)
            self.norm_2_post = make_norm(cfg) if cfg.sandwich_norm else None
        self.hooks = None  # decoderlab.hooks installs a dispatcher here; None = no hook points, the hot path

    def forward(self, x, *, padding_mask=None, positions=None, cache=None, attn_mask=None):
        hooks = self.hooks
        if hooks is not None:
            x = hooks("hook_resid_pre", x)
        h = self.norm_1(x) if hooks is None else hooked_norm(self.norm_1, x, hooks, "ln1")
        a = self.attention(h, padding_mask=padding_mask, positions=positions, cache=cache, attn_mask=attn_mask)
        if self.norm_1_post is not None:
            a = self.norm_1_post(a) if hooks is None else hooked_norm(self.norm_1_post, a, hooks, "ln1_post")
        if hooks is not None:
            a = hooks("hook_attn_out", a)
        out = x + a
        if self.has_mlp:
            if hooks is not None:
                out = hooks("hook_resid_mid", out)
            h2 = self.norm_2(out) if hooks is None else hooked_norm(self.norm_2, out, hooks, "ln2")
            m = self.mlp(h2)
            if self.norm_2_post is not None:
                m = self.norm_2_post(m) if hooks is None else hooked_norm(self.norm_2_post, m, hooks, "ln2_post")
            if hooks is not None:
                m = hooks("hook_mlp_out", m)
            out = out + m
        return out if hooks is None else hooks("hook_resid_post", out)


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------


class DecoderOnlyTransformer(nn.Module):
    """A decoder-only (GPT-style) transformer: a plain ``torch.nn.Module`` (the lesson's is a
    ``LightningModule``; here Lightning wraps it for training, see :mod:`decoderlab.training`).

    Build it from a config or a preset, or with the lesson's arguments::

        DecoderOnlyTransformer(num_tokens=5, d_model=2, max_len=6)   # the lesson (statquest preset)
        DecoderOnlyTransformer(preset("baby-shakespeare"))
        DecoderOnlyTransformer("gpt2")

    ``forward(token_ids)``: (T,) -> logits (T, num_tokens) as in the lesson, or (B, T) -> (B, T, num_tokens).
    Optional keywords: ``padding_mask`` (B, T_k) bool, True = padded key; ``positions`` (T,) or (B, T), each
    in 0 .. max_len - 1; and ``cache`` (an ``attention.KVCache``) for decoding; ``decode`` is the engine's
    one-token step. With a ``padding_mask`` and no ``positions``, the positions come from the mask
    (:meth:`positions_from_mask`): a left-padded row gives its real tokens the logits of the unpadded run,
    for every position kind.

    Training: ``compute_loss((inputs, labels))`` is the lesson's ``nn.CrossEntropyLoss`` (labels of -100
    ignored), and ``configure_optimizers()`` the lesson's Adam(lr=0.1); ``decoderlab.training.LitModel``
    wraps the model for Lightning's ``Trainer`` (the lesson's ``training_step``).

    Hook points: TransformerLens's names (``hook_embed``, ``blocks.L.attn.hook_pattern`` ...), listed and
    installed by :mod:`decoderlab.hooks`; with none installed (every ``hooks`` attribute None) a pass pays one
    ``is None`` test per point.

    Raises:
        ValueError: token ids outside [0, num_tokens), a sequence longer than max_len, a negative position or
            one past max_len - 1, a bad shape.
    """

    def __init__(self, config: ModelConfig | str | None = None, *, num_tokens: int | None = None,
                 d_model: int | None = None, max_len: int | None = None, lr: float = 0.1, **overrides):
        super().__init__()
        lesson = {k: v for k, v in dict(num_tokens=num_tokens, d_model=d_model, max_len=max_len).items()
                  if v is not None}
        overrides = {**lesson, **overrides}
        if config is None:
            config = preset("statquest", **{"num_tokens": 4, **overrides})
        elif isinstance(config, str):
            config = preset(config, **overrides)
        elif isinstance(config, dict):
            config = ModelConfig.from_dict({**config, **overrides})
        elif not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, a preset name or a dict, got {type(config).__name__}")
        elif overrides:
            config = config.replace(**overrides)
        config.validate()
        self.config = config
        self.lr = lr
        cfg = config

        self.we = nn.Embedding(num_embeddings=cfg.num_tokens, embedding_dim=cfg.d_model)
        rope = None
        if cfg.position == "sinusoidal":
            self.pe = PositionEncoding(d_model=cfg.d_model, max_len=cfg.max_len)
        elif cfg.position == "learned":
            self.pe = LearnedPositionEncoding(cfg.d_model, cfg.max_len)
        else:
            self.pe = None
            if cfg.position == "rope":
                rope = RotaryEmbedding(cfg.d_head, cfg.max_len, cfg.rope_theta, cfg.rope_layout)
        # the sliding layers' own rotary base (Gemma 3: 10,000 there, 1,000,000 on the full layers), one table each
        local = cfg.rope_theta_of(next((i for i in range(cfg.n_layer) if cfg.window_of(i)), 0))
        rope_local = rope if rope is None or local == cfg.rope_theta else RotaryEmbedding(
            cfg.d_head, cfg.max_len, local, cfg.rope_layout)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([DecoderBlock(cfg, rope_local if cfg.window_of(i) else rope, i)
                                     for i in range(cfg.n_layer)])
        self.norm_f = make_norm(cfg)
        self.fc_layer = nn.Linear(in_features=cfg.d_model, out_features=cfg.num_tokens, bias=cfg.lm_head_bias)
        self.tie_weights()
        # load_state_dict(..., assign=True) puts the state's tensors in place one by one: tie them again
        self.register_load_state_dict_post_hook(lambda module, incompatible_keys: module.tie_weights())
        self.loss = nn.CrossEntropyLoss(ignore_index=-100)
        self.compiled_decode = None  # decode compiled by compile_decode: what the engine then steps with
        self.hooks = None  # hook points hook_embed, hook_pos_embed, ln_final.* when decoderlab.hooks installs them
        if cfg.init == "gpt2":
            self.apply(self._gpt2_init)
            for name, p in self.named_parameters():
                if name.endswith("attention.proj.weight") or name.endswith("mlp.proj.weight"):
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.zero_init:  # every block starts as the identity
            for name, p in self.named_parameters():
                if name.endswith(("attention.proj.weight", "mlp.proj.weight")):
                    nn.init.zeros_(p)

    @staticmethod
    def _gpt2_init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def tie_weights(self) -> None:
        """With ``config.tie_weights``, make ``fc_layer.weight`` the word embedding parameter ``we.weight`` (one
        tensor, counted and updated once). Called at construction and again after every way of loading or
        moving the model that can put separate tensors in place: ``load_state_dict(..., assign=True)`` (the
        meta-device pattern), ``to_empty``, ``to``/``half``/... (see ``_apply``). Block-quantized layers
        (:mod:`decoderlab.quant`) share their planes instead."""
        if not self.config.tie_weights:
            return
        if is_block_layer(self.fc_layer) or is_block_layer(self.we):
            tie_block_weights(self)
        elif self.fc_layer.weight is not self.we.weight:
            self.fc_layer.weight = self.we.weight

    def _apply(self, fn, recurse=True):
        # nn.Module converts each module's parameters on its own; where it makes new Parameter objects (to_empty
        # from the meta device) the shared one becomes two. Re-tie after every conversion.
        super()._apply(fn, recurse)
        self.tie_weights()
        return self

    @torch.no_grad()
    def resize_token_embeddings(self, num_tokens: int) -> nn.Module:
        """Grow the vocabulary to ``num_tokens`` in place (Hugging Face's ``resize_token_embeddings``) and return
        the new word embedding ``we`` (num_tokens, d_model).

        The new rows of the embedding -- and of an untied ``fc_layer`` (weight rows and bias entries) -- start
        at the mean of the old rows, so a new token begins as an "average" token rather than at random (as
        Hugging Face's mean resizing, without its sampled noise); the old rows are kept exactly. A tied head
        stays tied (one ``Parameter``). ``config.num_tokens`` follows. Unchanged size: nothing changes. A word
        embedding (and output layer) held in GGUF blocks of a type decoderlab quantizes to (q8_0, q4_0, q4_1,
        q5_0, q5_1: a GGUF file's embedding is mostly q8_0) stays in its blocks, the mean row quantized to that
        type (:func:`decoderlab.quant.grown_rows`: a float32 copy of Gemma 3's embedding would be 671 MB, 2.7x
        its whole file); a K-quant one becomes float first (its dequantized weight). The other block layers stay
        as they are.

        Raises:
            ValueError: ``num_tokens`` is not an integer or smaller than the current vocabulary.
        """
        old = self.config.num_tokens
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ValueError(f"num_tokens must be an integer, got {num_tokens!r}")
        if num_tokens < old:
            raise ValueError(f"cannot shrink the vocabulary from {old} to {num_tokens} tokens")
        if num_tokens == old:
            return self.we

        def grown(t: torch.Tensor) -> nn.Parameter:
            mean = t.mean(dim=0, keepdim=True)
            return nn.Parameter(torch.cat([t, mean.expand(num_tokens - old, *t.shape[1:])], dim=0),
                                requires_grad=t.requires_grad)

        in_blocks = self._grown_in_blocks(num_tokens - old)
        if not in_blocks:
            self._float_vocabulary()
            self.we.weight = grown(self.we.weight)
            self.we.num_embeddings = num_tokens
        self.config = self.config.replace(num_tokens=int(num_tokens))
        if not self.config.tie_weights and not is_block_layer(self.fc_layer):
            self.fc_layer.weight = grown(self.fc_layer.weight)
        if self.fc_layer.bias is not None:
            self.fc_layer.bias = grown(self.fc_layer.bias)
        self.fc_layer.out_features = num_tokens
        self.tie_weights()
        return self.we

    def _grown_in_blocks(self, count: int) -> bool:
        """Append ``count`` rows to a word embedding held in blocks -- and to its tied output layer, or an untied
        one in blocks -- in their blocks (:func:`decoderlab.quant.grown_rows`); False, nothing changed, where
        the embedding is float or a layer's block type has no quantizer here."""
        we, head, tied = self.we, self.fc_layer, self.config.tie_weights
        if not is_block_layer(we) or (not tied and is_block_layer(head) and len(head.kinds) != 1):
            return False
        embedding = grown_rows(we.blocks, count)
        output = embedding if tied else grown_rows(head.blocks, count) if is_block_layer(head) else head
        if embedding is None or output is None:
            return False
        self.we = BlockEmbedding(embedding)
        self.we.out_dtype = we.out_dtype
        if tied or is_block_layer(head):
            self.fc_layer = BlockLinear(output, head.bias)
            self.fc_layer.out_dtype = head.out_dtype if is_block_layer(head) else we.out_dtype
        return True

    def _float_vocabulary(self) -> None:
        """The word embedding and output layer as ordinary float layers (the dtype of the model's float parts)
        where they hold GGUF blocks: their dequantized weights (a tied pair sharing one ``Parameter`` again)."""
        we, head, tied = self.we, self.fc_layer, self.config.tie_weights
        # (the layers made on the meta device and the weights put in: no allocation or initialisation of another
        # matrix the vocabulary's size; a tied output layer's weight is the embedding's, not dequantized again)
        if is_block_layer(we):
            w = we.dequantize(we.out_dtype)
            self.we = nn.Embedding(*w.shape, device="meta", dtype=w.dtype)
            self.we.weight = nn.Parameter(w)
        if is_block_layer(head):
            w = self.we.weight if tied else nn.Parameter(head.dequantize(head.out_dtype))
            bias = head.bias
            self.fc_layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
            self.fc_layer.weight = w
            self.fc_layer.bias = bias
        self.tie_weights()

    # -- sizes ------------------------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def num_tokens(self) -> int:
        return self.config.num_tokens

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters (shared tensors counted once), the weights a block-quantized layer holds in its
        blocks among them (:func:`decoderlab.quant.block_weights`: buffers, not parameters, one weight per
        integer) -- a model loaded with ``dtype="q4_1"`` counts what it counts in float32. ``non_embedding`` leaves
        out the word and learned position embeddings (and ``fc_layer.weight`` when it is tied to them)."""
        seen, total = set(), block_weights(self)
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        if non_embedding:
            total -= self.we.num_embeddings * self.we.embedding_dim
            if isinstance(self.pe, LearnedPositionEncoding):
                total -= self.pe.weight.numel()
        return total

    # -- forward ----------------------------------------------------------------------------------------------
    def check_token_ids(self, token_ids: torch.Tensor, *, values: bool = True) -> None:
        """Raise ``ValueError`` for ids outside [0, num_tokens), a bad dtype/shape, or T > max_len.

        ``values=False`` checks the type, dtype and shape only: reading the smallest and largest id waits for
        the device (a host sync), which the training step leaves to where its ids come from (the data,
        checked once on the host)."""
        if not isinstance(token_ids, torch.Tensor):
            raise TypeError(f"token_ids must be a torch.Tensor of integer ids, got {type(token_ids).__name__}")
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must be integer ids, got dtype {token_ids.dtype}")
        if token_ids.dim() not in (1, 2):
            raise ValueError(f"token_ids must have shape (T,) or (B, T), got {tuple(token_ids.shape)}")
        if values and token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.config.num_tokens:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} is out of range; allowed ids are 0 .. {self.config.num_tokens - 1} "
                    f"(num_tokens={self.config.num_tokens})"
                )

    def forward(self, token_ids: torch.Tensor, *, padding_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache=None, last_only: bool = False,
                check_ids: bool = True, attn_mask: torch.Tensor | None = None,
                select: torch.Tensor | None = None, head=None) -> torch.Tensor:
        """Logits of every position: (T,) -> (T, num_tokens), or (B, T) -> (B, T, num_tokens).

        ``last_only=True`` runs the final norm and ``fc_layer`` on the last position alone and returns its
        logits as (1, num_tokens) (or (B, 1, num_tokens)): the generation engine's prefill needs no others,
        and the output layer then costs one position instead of T. The last row equals the full forward's.
        ``check_ids=False`` skips the range check of the ids (not their dtype and shape), for callers that
        checked them once on the host (training, evaluation): it would wait for the device every forward; it
        skips the range check of given ``positions`` too.

        Packed rows (several conversations in one row, :func:`decoderlab.training.rows.pack_rows`) take
        ``positions`` (B, T) and ``attn_mask``: a bool mask broadcastable to (B, n_head, T, T), True = a key the
        query must not see, added to the causal mask in every layer. ``select``: a 1-D int64 tensor of indices
        into the flattened (B * T) positions; the final norm and the output layer then run on those positions
        alone and the logits are (len(select), num_tokens) -- a fine-tuning step needs the logits of its
        supervised tokens only, and over a 49,152-token vocabulary the output layer and the float32
        log-softmax of every position cost a quarter of the step. ``head``: a function ``head(project, hidden)``
        called in place of the output layer, ``project`` mapping (..., d_model) -> (..., num_tokens) logits and
        ``hidden`` the final norm's output ((K, d_model) with ``select``); its result is returned as it is --
        a loss taken a slice of rows at a time (:func:`decoderlab.training.rows.chunked_ce_sum`) never holds
        the logits of every row, which over Gemma 3's 262,144-token vocabulary are 1 MB a row.
        """
        self.check_token_ids(token_ids, values=check_ids)
        unbatched = token_ids.dim() == 1
        if unbatched:
            token_ids = token_ids.unsqueeze(0)
        t = token_ids.size(1)
        if positions is None and padding_mask is not None:
            positions = self.positions_from_mask(padding_mask, t)
        elif positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
                raise TypeError(f"positions must be a tensor of integer positions, got {positions!r:.80}")
            if check_ids:
                check_positions(positions, self.config.max_len)
        if positions is None:
            start = cache.length if cache is not None else 0
            if start + t > self.config.max_len:
                raise ValueError(
                    f"sequence length T={start + t} is longer than max_len={self.config.max_len}; "
                    f"allowed: T <= {self.config.max_len}"
                )
            if start:
                positions = torch.arange(start, start + t, device=token_ids.device)
        logits = self._logits(token_ids, padding_mask, positions, cache, last_only, attn_mask, select, head)
        if cache is not None:
            cache.advance(t)
        return logits[0] if unbatched and select is None and head is None else logits

    @staticmethod
    def positions_from_mask(padding_mask: torch.Tensor, t: int) -> torch.Tensor:
        """The positions of the last ``t`` keys of a (B, T_k) padding mask (True = padded): each token's
        index among the unpadded tokens of its row (Hugging Face derives ``position_ids`` from the attention
        mask the same way). Left-padded rows then give their real tokens 0, 1, ... as unpadded; pads get 0.
        Returns (B, t) int64.

        Raises:
            ValueError: the mask is not 2-D (B, T_k) with T_k >= t.
        """
        if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2 or padding_mask.size(1) < t:
            shape = tuple(padding_mask.shape) if isinstance(padding_mask, torch.Tensor) else type(padding_mask).__name__
            raise ValueError(f"padding_mask must have shape (B, T_k) with T_k >= T={t} (True = padded key); "
                             f"got {shape}")
        real = (~padding_mask.to(torch.bool)).long()
        return (real.cumsum(-1) - 1).clamp_min(0)[:, padding_mask.size(1) - t:]

    def decode(self, tokens: torch.Tensor, positions, padding_mask: torch.Tensor | None, cache) -> torch.Tensor:
        """One KV-cache decode step, for the generation engine: the same blocks as ``forward`` without its
        argument checks (the engine made them once per call, on the host: a check here would wait for the
        device at every token).

        Args:
            tokens: (B, 1) the new token of each row.
            positions: (1,) (every row at that position) or (B, 1) per-row positions; an int is taken too,
                but a compiled step needs a tensor (an int would be compiled in).
            padding_mask: None, or (B, T_k) bool over the cached keys and the new one, True = padded (the new
                token never is). With a static cache T_k may be up to its capacity.
            cache: the ``KVCache`` holding the earlier keys and values. The step writes the new ones into it
                but does not advance it: the caller calls ``cache.advance(1)`` afterwards, so that the step
                changes no Python state and compiles to one graph (:meth:`compile_decode`).

        Returns the logits of the new tokens, (B, num_tokens).
        """
        if not torch.compiler.is_compiling():  # eager: one C++ call for the step, where the model takes it
            fused = fastdecode.step(self, tokens, positions, padding_mask, cache)
            if fused is not None:
                return fused
        if isinstance(positions, int):
            positions = torch.full((1,), positions, dtype=torch.long, device=tokens.device)
        return self._logits(tokens, padding_mask, positions, cache)[:, -1]

    def compile_decode(self, *, cpp_wrapper: bool | None = None, **options):
        """Compile :meth:`decode` as ``torch.compile(self.decode, fullgraph=True, **options)`` (torch.compile's
        ``mode``, ``backend``, ``dynamic``, ``options``) and keep it as ``compiled_decode``, which the generation
        engine and the scheduler then decode with -- the engine over a static KV cache (``KVCache(static=True)``:
        the same shapes and no changing Python number at every token, so one graph serves the whole context).
        Returns it. ``model.compiled_decode = None`` goes back to eager decoding.

        ``cpp_wrapper``: run the compiled step through Inductor's C++ wrapper, so that a step is one call into
        compiled code with no Python between its kernels (``torch._inductor.config.cpp_wrapper``). Default: on
        for Inductor on a CPU (measured faster there, ``bench/generate.py``), off elsewhere and with a ``mode``
        (torch.compile takes ``mode`` or ``options``, not both). The first step compiles: seconds on a GPU, a
        minute or more with a C++ compiler on a loaded CPU; Inductor keeps what it compiled on disk (its FX graph
        cache), so a later process with the same model shape compiles faster. With block-quantized weights the C++
        compiler may fuse a multiply and an add into one instruction (``decoderlab.quant.FAST_CONTRACT``). A compiled model does not pickle
        or deep-copy.

        ``mode="aot"``: ahead of time instead (:class:`decoderlab.aot.AOTDecodeStep`: ``torch.export`` +
        AOTInductor, a ``.pt2`` package per batch size written once to ``cache_dir`` -- default
        ``~/.cache/decoderlab/aot`` -- and loaded, not compiled, by any later process with a model of the same shape
        and dtype; the package reads the model's own weights);
        ``cache_dir`` is its only option (``TypeError`` naming any other); tensor-subclass weights raise
        ``ValueError``."""
        if options.get("mode") == "aot":
            from .aot import AOTDecodeStep

            other = sorted(set(options) - {"mode", "cache_dir"}) + (["cpp_wrapper"] if cpp_wrapper is not None else [])
            if other:
                raise TypeError(f"compile_decode(mode='aot') takes cache_dir only, got {', '.join(other)}")
            self.compiled_decode = AOTDecodeStep(self, options.get("cache_dir"))
            return self.compiled_decode
        backend = options.get("backend", "inductor")
        on_cpu = all(p.device.type == "cpu" for p in self.parameters())
        if cpp_wrapper is None:
            cpp_wrapper = backend == "inductor" and on_cpu and "mode" not in options
        if cpp_wrapper:
            options["options"] = {"cpp_wrapper": True, **(options.get("options") or {})}
        if backend == "inductor" and on_cpu and "mode" not in options and block_dtype(self):
            options["options"] = {**FAST_CONTRACT, **(options.get("options") or {})}
        self.compiled_decode = torch.compile(self.decode, fullgraph=True, **options)
        return self.compiled_decode

    def _logits(self, token_ids, padding_mask, positions, cache, last_only: bool = False, attn_mask=None,
                select=None, head=None) -> torch.Tensor:
        """The forward pass proper: (B, T) ids -> (B, T, num_tokens) logits ((B, 1, num_tokens) if last_only).
        Positions are taken as given (``forward`` checked them; ``decode``'s caller made them)."""
        hooks = self.hooks
        x = self.we(token_ids)  # (B, T, d_model)
        if self.config.embed_scale:  # sqrt(d_model) rounded to the embedding's dtype first, as transformers does
            x = x * embed_scale(self.config.d_model, x)
        if hooks is not None:
            x = hooks("hook_embed", x)
        if self.pe is not None and hooks is None:
            x = self.pe(x, positions, check=False)  # + position encodings (rope is applied inside attention)
        elif self.pe is not None:  # the positions as their own term of the residual stream (same sum)
            x = x + hooks("hook_pos_embed", self.pe(torch.zeros_like(x), positions, check=False))
        x = self.drop(x)
        if cache is not None and cache.static and token_ids.size(1) == 1:  # a static step writes one column
            padding_mask = cache.step_mask(padding_mask, token_ids.size(0))  # and hides the unwritten ones
        for i, block in enumerate(self.blocks):  # (B, T, d_model) -> (B, T, d_model)
            x = block(x, padding_mask=padding_mask, positions=positions,
                      cache=None if cache is None else cache.layers[i], attn_mask=attn_mask)
        if last_only:
            x = x[:, -1:]  # (B, 1, d_model): the output layer only where the next token is predicted
        elif select is not None:  # (K, d_model): the output layer only where a target is scored
            x = x.reshape(-1, x.size(-1)).index_select(0, select)
        x = self.norm_f(x) if hooks is None else hooked_norm(self.norm_f, x, hooks, "ln_final")
        if head is not None:  # (inside forward: under FSDP the output layer's weights are gathered only here)
            return head(functools.partial(linear, self.fc_layer), x)
        return linear(self.fc_layer, x)  # (B, T, num_tokens)

    # -- the lesson's training pieces (plain torch; Lightning's wrapper is decoderlab.training.LitModel) ----
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The lesson's optimizer: ``Adam(self.parameters(), lr=self.lr)`` (lr 0.1 by default)."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def compute_loss(self, batch, *, check_ids: bool = True) -> torch.Tensor:
        """Mean cross-entropy (nats per token) of ``batch = (inputs, labels)``; labels of -100 are ignored.
        ``check_ids``: as for ``forward`` (training passes False: its data was checked where it came from)."""
        input_tokens, labels = batch[0], batch[1]
        output = self(input_tokens, check_ids=check_ids)  # through __call__: hooks (FSDP's gathers) run
        return self.loss(output.reshape(-1, output.size(-1)), labels.reshape(-1))
