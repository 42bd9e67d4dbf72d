"""Generation: logits -> tokens. The lesson's greedy loop, and the key/value cache used for fast decoding.

Inference lives apart from the model (as nanochat's engine apart from its gpt.py): the model only knows how
to run a forward pass over new tokens with an optional ``KVCache``.

Public API: :func:`generate` / :func:`stream` (one prompt; tokens as a list or yielded as produced),
:func:`generate_batch` (prompts of different lengths, left-padded), :func:`stream_text` / :class:`TextStreamer`
(text pieces that never split a character), :class:`Sampler` (greedy, temperature, top-k, top-p),
:class:`ChatSession` (the ``decoderlab chat`` loop), :func:`greedy_response` (the lesson's loop). With the cache
the tokens are exactly those of the lesson's loop (``use_cache=False``), greedy or seeded; see :func:`stream`
for the context-window rule past max_len.
"""

from __future__ import annotations

import math
from typing import Generator, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerKVCache:
    """Keys and values of one layer, preallocated once: k, v of shape (B, H, capacity, d_head).

    ``update(k_new, v_new)`` writes the new keys/values (B, H, T_new, d_head) after the ones already held and
    returns views of all of them, (B, H, length + T_new, d_head). The owning :class:`KVCache` advances the
    shared length once per forward pass.
    """

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.owner.length
        end = start + k_new.size(2)
        if end > self.owner.capacity:
            raise ValueError(f"KV cache is full: {end} tokens would exceed its capacity of {self.owner.capacity}")
        if self.k is None or self.k.size(0) != k_new.size(0) or self.k.dtype != k_new.dtype:
            b, h, _, d = k_new.shape
            self.k = k_new.new_empty(b, h, self.owner.capacity, d)
            self.v = v_new.new_empty(b, h, self.owner.capacity, d)
        self.k[:, :, start:end] = k_new
        self.v[:, :, start:end] = v_new
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """A per-layer key/value cache for a ``DecoderOnlyTransformer``, allocated once per generation call.

    Args:
        n_layer: number of decoder blocks.
        capacity: most tokens it holds (the model's max_len).

    ``length`` is the number of positions already cached; the model's forward pass reads it (new tokens get
    positions length .. length+T-1) and then calls ``advance(T)``. ``reset()`` empties it for reuse.
    """

    def __init__(self, n_layer: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.layers = [LayerKVCache(self) for _ in range(n_layer)]

    @classmethod
    def for_model(cls, model) -> "KVCache":
        return cls(model.config.n_layer, model.config.max_len)

    def advance(self, t: int) -> None:
        self.length += t

    def reset(self) -> None:
        self.length = 0


@torch.no_grad()
def greedy_response(model, prompt_ids: Sequence[int] | torch.Tensor, eos_id: int) -> list[int]:
    """The lesson's greedy loop for a model trained on prompt/response pairs.

    The prompt must end in ``<EOS>`` (``eos_id``): the library does not append it silently (the CLI does).
    Appends the argmax token, re-running the whole sequence each time as the lesson does, until ``<EOS>`` is
    produced or the sequence reaches max_len tokens.

    Args:
        model: a ``DecoderOnlyTransformer``.
        prompt_ids: (T,) token ids ending with ``eos_id``.
        eos_id: the id of ``<EOS>``.

    Returns:
        the generated ids (the response, ending with ``eos_id`` if the model produced it).

    Raises:
        ValueError: the prompt is empty, does not end in ``<EOS>``, or is already max_len long or longer.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; it must end with the <EOS> token")
    if int(ids[-1]) != eos_id:
        raise ValueError(
            f"the prompt must end with <EOS> (id {eos_id}) for a model trained on prompt/response pairs; "
            f"it ends with id {int(ids[-1])}. Append <EOS> (the CLI does so for you)."
        )
    max_len = model.config.max_len
    if ids.numel() >= max_len:
        raise ValueError(f"the prompt has {ids.numel()} tokens; it must be shorter than max_len={max_len}")
    was_training = model.training
    model.eval()
    try:
        generated: list[int] = []
        while ids.numel() < max_len:
            predictions = model(ids)
            next_id = int(torch.argmax(predictions[-1, :]))
            generated.append(next_id)
            ids = torch.cat((ids, torch.tensor([next_id])))
            if next_id == eos_id:
                break
        return generated
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------------------
# The inference engine: sampling, the context window, stop sequences, streaming, batches, chat
# ----------------------------------------------------------------------------------------------------------
#
# One engine (``_steps``) serves every entry point. It runs B rows at once (B = 1 for ``generate`` and
# ``stream``), each row with its own *context window* ``ids[start:]`` of at most max_len tokens:
#
# * with the cache, the window is prefilled once (left-padded to a common length for B > 1, with a padding mask
#   and per-row positions so that every row starts at position 0), then each new token is one forward pass
#   of one token per row;
# * without the cache (``use_cache=False``, the lesson's loop), every step runs the whole window of each row
#   through the model and keeps the last position's logits.
#
# Both follow the same window rule (``_slide``), which is what keeps them exactly equal.


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def check_sampling(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise for bad sampling settings: temperature must be a finite number >= 0 (0 = greedy), top_k an
    integer >= 1 (or None), top_p a number in (0, 1] (or None).

    Raises:
        ValueError: a value out of range (named, with what is allowed). TypeError: a value of the wrong type.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a number in (0, 1], got {top_p!r}")
        if not (0.0 < top_p <= 1.0):  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")


class Sampler:
    """Choose the next token of each row from its logits: greedy, temperature, top-k and top-p.

    Args:
        temperature: 0 means greedy (argmax, no division); otherwise the logits are divided by it.
        top_k: keep the k largest logits (clamped to the vocabulary; ties with the k-th value are kept).
        top_p: keep the smallest set of most probable tokens whose probability reaches top_p (nucleus
            sampling, Holtzman et al. 2019); the most probable token is always kept. 1 keeps all.

    ``sampler(logits, generators)``: logits (B, V); ``generators`` a list of B ``torch.Generator`` (one per
    row; each row draws exactly one uniform number per token, so a row's tokens depend only on its own
    generator and logits). Returns (B,) token ids. Sampling is by inverse CDF on one uniform draw (no sort
    unless top_p is set). The global RNG is never used.

    Raises: see :func:`check_sampling`.
    """

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
        check_sampling(temperature, top_k, top_p)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = None if top_p is None or top_p >= 1.0 else float(top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) divided by the temperature, with the tokens top-k/top-p leave out set to -inf."""
        logits = logits / self.temperature
        v = logits.size(-1)
        if self.top_k is not None and self.top_k < v:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None:
            probs = torch.softmax(logits, dim=-1)
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the more probable tokens
            drop_sorted = before >= self.top_p  # the first token has before == 0 < top_p: always kept
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def __call__(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(dim=-1)
        if logits.dtype in (torch.float16, torch.bfloat16):  # a CDF needs more precision than 8 bits
            logits = logits.float()
        probs = torch.softmax(self.filter(logits), dim=-1)
        cdf = probs.cumsum(dim=-1)
        if len(generators) == 1:
            u = torch.rand(1, generator=generators[0], dtype=torch.float64, device=logits.device)
        else:
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=logits.device)
                           for g in generators])
        x = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # in [0, total): the first cdf > x has prob > 0
        ids = torch.searchsorted(cdf, x, right=True).squeeze(-1)
        return ids.clamp_max_(logits.size(-1) - 1)


def default_keep(max_len: int) -> int:
    """Tokens kept when the context window slides: max_len // 2 (at least 1)."""
    return max(1, max_len // 2)


def _slide(n: int, start: int, max_len: int, keep: int) -> int:
    """The context-window rule shared by the cached and the uncached loop.

    A row of n tokens whose window ``ids[start:]`` has grown past max_len restarts on its last ``keep``
    tokens; otherwise the window keeps growing.
    """
    return n - keep if n - start > max_len else start


def _model_device(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _prompt_list(model, prompt_ids, tokenizer, name: str = "prompt_ids") -> list[int]:
    """Validate a prompt: ids as a list/tuple/1-D tensor (or text when a tokenizer is given)."""
    if isinstance(prompt_ids, str):
        if tokenizer is None:
            raise TypeError(f"{name} is text ({prompt_ids[:30]!r}); pass token ids, or the tokenizer to encode it")
        prompt_ids = tokenizer.encode(prompt_ids)
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool or prompt_ids.dim() > 1:
            raise ValueError(f"{name} must be a 1-D tensor of integer ids, got dtype {prompt_ids.dtype} "
                             f"and shape {tuple(prompt_ids.shape)}")
        ids = prompt_ids.tolist()
    else:
        try:
            ids = list(prompt_ids)
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids, got {type(prompt_ids).__name__}") from None
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"{name} must hold integer token ids, got {i!r}")
    v = model.config.num_tokens
    bad = [i for i in ids if not 0 <= i < v]
    if bad:
        raise ValueError(f"{name}: token id {bad[0]} is out of range; allowed ids are 0 .. {v - 1} "
                         f"(num_tokens={v})")
    if not ids:
        eos = getattr(tokenizer, "eos_id", None) if tokenizer is not None else None
        if eos is None:
            raise ValueError(
                f"{name} is empty and the model has no start token; give at least one token, or pass a "
                f"tokenizer with <EOS> (an empty prompt then starts from <EOS>)"
            )
        ids = [eos]
    return ids


def _stop_sequences(stop, tokenizer, num_tokens: int) -> list[tuple[int, ...]]:
    """Normalise ``stop`` to a list of token-id sequences (see :func:`stream`)."""
    if stop is None:
        return []
    if isinstance(stop, torch.Tensor):
        stop = stop.tolist()
    if isinstance(stop, (int, str)) or (isinstance(stop, Sequence) and stop and
                                        all(isinstance(t, int) for t in stop) and not isinstance(stop, list)):
        # a single id, a single string, or a tuple of ids (one multi-token stop sequence)
        items = [stop]
    else:
        items = list(stop)
    seqs: list[tuple[int, ...]] = []
    for item in items:
        if isinstance(item, bool):
            raise TypeError(f"stop must be token ids or strings, got {item!r}")
        if isinstance(item, int):
            seq = (item,)
        elif isinstance(item, str):
            if item == "":
                raise ValueError("a stop string must not be empty")
            if tokenizer is None:
                raise TypeError(f"stop string {item!r} needs the tokenizer: pass tokenizer=... (or give token ids)")
            vocab = getattr(tokenizer, "token_to_id", None)
            try:
                if isinstance(vocab, dict) and item in vocab:  # one whole token, e.g. "<EOS>"
                    seq = (vocab[item],)
                else:
                    seq = tuple(tokenizer.encode(item))
            except (KeyError, ValueError) as e:
                msg = e.args[0] if e.args else e
                raise ValueError(f"stop string {item!r} cannot be encoded by the tokenizer: {msg}") from None
            if not seq:
                raise ValueError(f"stop string {item!r} encodes to no tokens")
        elif isinstance(item, (Sequence, torch.Tensor)):
            seq = tuple(int(t) for t in item)
            if not seq:
                raise ValueError("a stop sequence of token ids must not be empty")
        else:
            raise TypeError(f"stop must be token ids or strings, got {item!r}")
        bad = [t for t in seq if not 0 <= t < num_tokens]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is out of range; allowed ids are 0 .. {num_tokens - 1}")
        seqs.append(seq)
    return seqs


class StopMatcher:
    """Stops a stream of token ids before a stop sequence, holding back tokens that could start one.

    ``push(token)`` returns ``(ids safe to emit, matched stop sequence or None)``; ``flush()`` returns the
    held-back ids when generation ends without a match. Matching is on token ids: a stop string is matched
    when the model produces the ids ``tokenizer.encode(stop)``, not another tokenization of the same text.
    """

    def __init__(self, sequences: Sequence[tuple[int, ...]]):
        self.sequences = [tuple(s) for s in sequences]
        self.held: list[int] = []

    def push(self, token: int) -> tuple[list[int], tuple[int, ...] | None]:
        held = self.held
        held.append(token)
        if not self.sequences:
            out, self.held = held, []
            return out, None
        for seq in self.sequences:
            if len(held) >= len(seq) and tuple(held[-len(seq):]) == seq:
                out, self.held = held[: len(held) - len(seq)], []
                return out, seq
        keep = 0  # the longest suffix of held that is a proper prefix of a stop sequence
        for seq in self.sequences:
            for k in range(min(len(seq) - 1, len(held)), keep, -1):
                if tuple(held[-k:]) == seq[:k]:
                    keep = k
                    break
        out, self.held = held[: len(held) - keep], held[len(held) - keep:]
        return out, None

    def flush(self) -> list[int]:
        out, self.held = self.held, []
        return out


def _generators(seed, n: int, device: torch.device) -> list[torch.Generator]:
    """One ``torch.Generator`` per row: seed None -> fresh entropy; an int -> every row seeded with it;
    a sequence of n ints -> one seed per row."""
    if seed is None:
        gens = []
        for _ in range(n):
            g = torch.Generator(device=device)
            g.seed()
            gens.append(g)
        return gens
    seeds = [seed] * n if isinstance(seed, int) and not isinstance(seed, bool) else list(seed)
    if len(seeds) != n:
        raise ValueError(f"seed must be an int or one int per prompt ({n}), got {len(seeds)} seeds")
    gens = []
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"seed must be an integer, got {s!r}")
        gens.append(torch.Generator(device=device).manual_seed(s))
    return gens


def _check_keep(keep, max_len: int) -> int:
    if keep is None:
        return default_keep(max_len)
    _check_int("keep", keep, 1)
    if keep > max_len:
        raise ValueError(f"keep must be in 1 .. max_len={max_len}, got {keep}")
    return keep


class DecodeStep:
    """One KV-cache decode step of a ``DecoderOnlyTransformer`` (one new token per row), written with functional
    calls over the model's own parameters -- the same math as ``model(tokens, cache=cache)`` without the
    per-module Python overhead (about half the per-token overhead at small widths; see docs/benchmarks.md).

    ``DecodeStep.for_model(model)`` returns None when the model is not a plain ``DecoderOnlyTransformer`` (a
    subclass or wrapper), has forward hooks, or a block/attention is recording for the glass box; the engine
    then calls the model itself. Attention runs ``F.scaled_dot_product_attention`` for both kernels (the
    kernels compute the same function; the exactness tests compare tokens against the model's forward pass).

    ``step(tokens (B, 1), positions, padding_mask, cache) -> logits (B, num_tokens)``: positions an int (every
    row at the same position, no padding) or (B, 1); padding_mask None or (B, T_k) bool, True = padded key.
    """

    def __init__(self, model):
        cfg = model.config
        self.d, self.h, self.dh = cfg.d_model, cfg.n_head, cfg.d_head
        self.we = model.we.weight
        self.position = cfg.position
        if cfg.position == "learned":
            self.table = model.pe.weight
        elif cfg.position == "sinusoidal":
            self.table = model.pe.pe
        else:
            self.table = None
        self.layers = []
        for blk in model.blocks:
            a = blk.attention
            mlp = blk.mlp if blk.has_mlp else None
            self.layers.append((
                self._norm(blk.norm_1), a.qkv.weight, a.qkv.bias, a.rope,
                None if a.proj is None else a.proj.weight, None if a.proj is None else a.proj.bias,
                self._norm(blk.norm_2) if mlp is not None else None,
                None if mlp is None else (mlp.fc.weight, mlp.fc.bias, mlp.proj.weight, mlp.proj.bias),
            ))
        self.norm_f = self._norm(model.norm_f)
        self.fc_w, self.fc_b = model.fc_layer.weight, model.fc_layer.bias

    @staticmethod
    def _norm(mod):
        from .model import RMSNorm

        if isinstance(mod, nn.Identity):
            return None
        if isinstance(mod, nn.LayerNorm):
            shape, w, b, eps = mod.normalized_shape, mod.weight, mod.bias, mod.eps
            return lambda x: F.layer_norm(x, shape, w, b, eps)
        if isinstance(mod, RMSNorm):
            w, eps = mod.weight, mod.eps
            return lambda x: F.rms_norm(x, (x.size(-1),), w, eps)
        raise TypeError(f"no functional form for {type(mod).__name__}")

    @classmethod
    def for_model(cls, model) -> "DecodeStep | None":
        from .model import DecoderOnlyTransformer, RMSNorm

        if type(model) is not DecoderOnlyTransformer:
            return None
        for mod in model.modules():
            if mod._forward_hooks or mod._forward_pre_hooks or getattr(mod, "record", None) is not None:
                return None
            if isinstance(mod, (nn.LayerNorm, RMSNorm)) and type(mod) not in (nn.LayerNorm, RMSNorm):
                return None
        return cls(model)

    def __call__(self, tokens: torch.Tensor, positions, padding_mask, cache: "KVCache") -> torch.Tensor:
        from .attention import sdpa_attention

        b, d, h, dh = tokens.size(0), self.d, self.h, self.dh
        x = F.embedding(tokens, self.we)  # (B, 1, d_model)
        if self.table is not None:
            x = x + self.table[positions]
        rope_pos = None
        if self.position == "rope":
            rope_pos = torch.tensor([positions], device=x.device) if isinstance(positions, int) else positions
        mask = None if padding_mask is None else padding_mask[:, None, None, :]
        for i, (norm_1, qkv_w, qkv_b, rope, proj_w, proj_b, norm_2, mlp) in enumerate(self.layers):
            hdn = norm_1(x) if norm_1 is not None else x
            q, k, v = F.linear(hdn, qkv_w, qkv_b).view(b, 1, 3, h, dh).permute(2, 0, 3, 1, 4)
            if rope is not None:
                q, k = rope.forward(q, rope_pos), rope.forward(k, rope_pos)
            k, v = cache.layers[i].update(k, v)
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v)
            else:
                y = sdpa_attention(q, k, v, mask)
            y = y.transpose(1, 2).reshape(b, 1, d)
            if proj_w is not None:
                y = F.linear(y, proj_w, proj_b)
            x = x + y
            if mlp is not None:
                fc_w, fc_b, p_w, p_b = mlp
                x = x + F.linear(F.gelu(F.linear(norm_2(x) if norm_2 is not None else x, fc_w, fc_b),
                                        approximate="tanh"), p_w, p_b)
        cache.advance(1)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return F.linear(x, self.fc_w, self.fc_b)[:, -1]


def _steps(model, rows: list[list[int]], max_new_tokens: int, sampler: Sampler,
           generators: list[torch.Generator], use_cache: bool, keep: int) -> Iterator[list[int]]:
    """The engine: yields, per step, the B next token ids; ``rows`` (lists of ids) are extended in place.

    Runs under ``torch.inference_mode`` for the caller (see the decorated callers) with the model in eval
    mode. The KV cache is allocated once and reused (re-prefilled) when a window slides.
    """
    if max_new_tokens == 0:
        return
    b = len(rows)
    max_len = model.config.max_len
    device = _model_device(model)
    starts = [max(0, len(r) - max_len) for r in rows]
    cache = KVCache.for_model(model) if use_cache else None
    pad_buf = torch.zeros(b, max_len, dtype=torch.bool, device=device)
    state = {"pads": None}  # (B, 1) pad counts of the current prefill, None when no row is padded

    def prefill() -> torch.Tensor:
        windows = [r[s:] for r, s in zip(rows, starts)]
        t = max(len(w) for w in windows)
        pads = [t - len(w) for w in windows]
        tokens = torch.tensor([[0] * p + w for p, w in zip(pads, windows)], dtype=torch.long, device=device)
        cache.reset()
        if any(pads):
            p = torch.tensor(pads, device=device).unsqueeze(1)  # (B, 1)
            ar = torch.arange(t, device=device).unsqueeze(0)
            pad_buf.zero_()
            pad_buf[:, :t] = ar < p
            state["pads"] = p
            logits = model(tokens, positions=(ar - p).clamp_min(0), padding_mask=pad_buf[:, :t], cache=cache)
        else:
            state["pads"] = None
            logits = model(tokens, cache=cache)
        return logits[:, -1]

    fast = DecodeStep.for_model(model) if use_cache else None

    def decode(next_ids: torch.Tensor) -> torch.Tensor:
        tokens = next_ids.view(b, 1)
        p = state["pads"]
        length = cache.length
        if fast is not None:
            if p is None:
                return fast(tokens, length, None, cache)
            return fast(tokens, length - p, pad_buf[:, : length + 1], cache)
        if p is None:
            return model(tokens, cache=cache)[:, -1]
        return model(tokens, positions=length - p, padding_mask=pad_buf[:, : length + 1], cache=cache)[:, -1]

    def full() -> torch.Tensor:  # the lesson's loop: the whole window, every step
        if b == 1:
            return model(torch.tensor([rows[0][starts[0]:]], dtype=torch.long, device=device))[:, -1]
        groups: dict[int, list[int]] = {}  # rows whose windows have the same length run as one batch
        for i, (r, s) in enumerate(zip(rows, starts)):
            groups.setdefault(len(r) - s, []).append(i)
        out = [None] * b
        for members in groups.values():
            tokens = torch.tensor([rows[i][starts[i]:] for i in members], dtype=torch.long, device=device)
            for i, row_logits in zip(members, model(tokens)[:, -1]):
                out[i] = row_logits
        return torch.stack(out)

    logits = prefill() if use_cache else full()
    for step in range(max_new_tokens):
        next_ids = sampler(logits, generators)
        new = next_ids.tolist()
        for r, t in zip(rows, new):
            r.append(t)
        yield new
        if step == max_new_tokens - 1:
            return
        slid = False
        for i, r in enumerate(rows):
            s = _slide(len(r), starts[i], max_len, keep)
            slid |= s != starts[i]
            starts[i] = s
        if not use_cache:
            logits = full()
        elif slid or cache.length + 1 > max_len:
            logits = prefill()
        else:
            logits = decode(next_ids)


def _validate(model, max_new_tokens, temperature, top_k, top_p) -> Sampler:
    _check_int("max_new_tokens", max_new_tokens, 0)
    return Sampler(temperature, top_k, top_p)


class _EvalMode:
    """Put the model in eval mode for the duration; restore its training flag afterwards."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.was_training = self.model.training
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


@torch.inference_mode()
def _stream_rows(model, rows, max_new_tokens, sampler, generators, use_cache, keep):
    # a decorated generator: inference mode is entered and left around each step, never leaking to the caller
    with _EvalMode(model):
        yield from _steps(model, rows, max_new_tokens, sampler, generators, use_cache, keep)


def stream(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, stop=None, seed=None, use_cache: bool = True, tokenizer=None,
           keep: int | None = None) -> Generator[int, None, tuple[int, ...] | None]:
    """Generate tokens one at a time, yielding each id as soon as it is known (the streaming ``generate``).

    Args:
        model: a ``DecoderOnlyTransformer`` (any dtype/device; it is put in eval mode for the call and its
            training flag restored afterwards).
        prompt_ids: the prompt, (T,) token ids (list, tuple or 1-D tensor), or text when ``tokenizer`` is
            given. An empty prompt starts from the tokenizer's ``<EOS>`` (the start token of decoderlab's
            models, which put ``<EOS>`` between texts); without a tokenizer that has one it is an error.
        max_new_tokens: the most tokens to produce (0 -> nothing). Tokens swallowed by a stop sequence count.
        temperature: 0 -> greedy (argmax); otherwise the logits are divided by it before sampling.
        top_k: sample only among the k most probable tokens (k larger than the vocabulary is clamped).
        top_p: sample only among the smallest set of most probable tokens whose probability reaches top_p.
        stop: where to stop, before emitting it: a token id, a string (encoded with ``tokenizer``; a string
            that is one token of the vocabulary, such as "<EOS>", is that token), a tuple of ids (one
            multi-token sequence), or a list of any of these. Tokens that could be the start of a
            multi-token stop sequence are held back until it is clear they are not.
        seed: seeds the ``torch.Generator`` used for sampling (the global RNG is never touched); the same
            seed gives the same tokens, with or without the cache. None -> fresh entropy.
        use_cache: True (default) prefills a KV cache once and then runs one token per forward pass; False is
            the lesson's loop (the whole window through the model for every token). Both give the same tokens.
        tokenizer: needed for stop strings, text prompts and the empty-prompt start token.
        keep: tokens kept when the context window slides (default max_len // 2; see below).

    The context window: the model sees at most max_len tokens. A prompt longer than that is cut to its last
    max_len tokens. When the window (prompt plus generated tokens) would pass max_len, it restarts on its
    last ``keep`` tokens and keeps growing from there -- with the cache, by recomputing (re-prefilling) the
    cache for that cropped window, for every position kind (learned, sinusoidal, rope, none), since cached
    keys carry their old positions. With the default ``keep = max_len // 2`` the re-prefill costs about one
    extra forward token per generated token; ``keep = max_len`` reproduces nanoGPT's crop-every-step (each
    step then re-prefills max_len tokens). The uncached loop applies exactly the same rule, so the two stay
    equal token for token.

    Yields:
        token ids (ints). The generator's return value (``StopIteration.value``) is the stop sequence that
        ended generation, or None.

    Raises:
        ValueError: max_new_tokens < 0; temperature < 0, NaN or infinite; top_k < 1; top_p outside (0, 1];
            prompt or stop ids out of range; an empty prompt with no start token; a stop string the tokenizer
            cannot encode; keep outside 1 .. max_len.
        TypeError: values of the wrong type; a stop string without a tokenizer.
    """
    sampler = _validate(model, max_new_tokens, temperature, top_k, top_p)
    ids = _prompt_list(model, prompt_ids, tokenizer)
    stops = StopMatcher(_stop_sequences(stop, tokenizer, model.config.num_tokens))
    keep = _check_keep(keep, model.config.max_len)
    gens = [] if sampler.greedy else _generators(seed, 1, _model_device(model))
    return _stream_one(model, ids, max_new_tokens, sampler, gens, use_cache, keep, stops)


def _stream_one(model, ids, max_new_tokens, sampler, gens, use_cache, keep, stops):
    for (token,) in _stream_rows(model, [ids], max_new_tokens, sampler, gens, use_cache, keep):
        out, matched = stops.push(token)
        yield from out
        if matched is not None:
            return matched
    yield from stops.flush()
    return None


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, stop=None, seed=None, use_cache: bool = True, tokenizer=None,
             keep: int | None = None) -> list[int]:
    """Continue a prompt: returns the new token ids (not the prompt, not a matched stop sequence).

    Same arguments, context-window rule and errors as :func:`stream` (this is ``list(stream(...))``).
    Source: the KV cache as in nanoGPT/nanochat's engines; top-p from Holtzman et al. 2019.
    """
    return list(stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, use_cache,
                       tokenizer, keep))


def generate_batch(model, prompts: Sequence, max_new_tokens: int, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, stop=None, seed=None,
                   use_cache: bool = True, tokenizer=None, keep: int | None = None) -> list[list[int]]:
    """Continue several prompts of different lengths at once; returns the new ids of each prompt.

    The prompts are left-padded to a common length; a padding mask hides the padded keys and each row gets
    its own positions, so every prompt starts at position 0 exactly as when generated alone. Each row follows
    its own context window (the rule of :func:`stream`); when a row's window slides, or the shared cache is
    full, the cache is re-prefilled with every row's current window. A row that hits a stop sequence is done
    (the others go on); the call ends when all rows are done or after max_new_tokens steps.

    Sampling: every row has its own ``torch.Generator``. ``seed`` an int seeds each row's generator with that
    same int, so row i gives the same tokens as ``generate(model, prompts[i], ..., seed=seed)`` (and equal
    prompts give equal samples); a list of ints seeds row i with ``seed[i]``; None draws fresh entropy.

    Args: as :func:`stream`, with ``prompts`` a list of prompts (token-id sequences, or texts with a tokenizer).

    Raises: as :func:`stream`; ValueError for an empty list of prompts or a seed list of the wrong length.
    """
    sampler = _validate(model, max_new_tokens, temperature, top_k, top_p)
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a text)")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    rows = [_prompt_list(model, p, tokenizer, name=f"prompts[{i}]") for i, p in enumerate(prompts)]
    seqs = _stop_sequences(stop, tokenizer, model.config.num_tokens)
    keep = _check_keep(keep, model.config.max_len)
    gens = [] if sampler.greedy else _generators(seed, len(rows), _model_device(model))
    matchers = [StopMatcher(seqs) for _ in rows]
    outs: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    steps = _stream_rows(model, rows, max_new_tokens, sampler, gens, use_cache, keep)
    for new in steps:
        for i, t in enumerate(new):
            if done[i]:
                continue
            emitted, matched = matchers[i].push(t)
            outs[i].extend(emitted)
            done[i] = matched is not None
        if all(done):
            steps.close()
            break
    for i, m in enumerate(matchers):
        if not done[i]:
            outs[i].extend(m.flush())
    return outs


# ----------------------------------------------------------------------------------------------------------
# Text streaming
# ----------------------------------------------------------------------------------------------------------


class TextStreamer:
    """Turns token ids into text pieces as they arrive, never splitting a character.

    Works for every decoderlab tokenizer using only ``decode``: each new piece is the text of the ids since
    the last emitted boundary, decoded together with the ids just before it (so word separators come out
    right), minus the text already emitted. While that text ends in U+FFFD -- a byte-level BPE token ended in
    the middle of a UTF-8 character -- nothing is emitted and the ids are held until the character completes.
    The concatenation of all pieces (``put`` ... then ``end``) equals ``tokenizer.decode(all ids)``.

    ``put(token_id) -> str`` (possibly ""); ``end() -> str`` flushes what is held (a character that never
    completed comes out as U+FFFD, as ``decode`` writes it).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were emitted already; decoded again only as context
        self.read = 0

    def put(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            piece = text[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def end(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


def stream_text(model, tokenizer, prompt: str | Sequence[int], max_new_tokens: int = 200,
                **kwargs) -> Iterator[str]:
    """Stream the continuation of ``prompt`` as text pieces (str), never splitting a UTF-8 character.

    ``prompt`` is text (encoded with ``tokenizer``) or token ids; ``kwargs`` are those of :func:`stream`
    (temperature, top_k, top_p, stop, seed, use_cache, keep). The pieces joined equal
    ``tokenizer.decode(generate(...))`` for the same arguments.
    """
    yield from _text_pieces(tokenizer, stream(model, prompt, max_new_tokens, tokenizer=tokenizer, **kwargs))


def _text_pieces(tokenizer, tokens: Iterator[int], produced: list[int] | None = None):
    """Whole-character text pieces of the ids ``tokens`` yields (appended to ``produced`` if given); returns
    the token generator's own return value (the stop sequence that ended it, or None)."""
    streamer = TextStreamer(tokenizer)
    while True:
        try:
            token = next(tokens)
        except StopIteration as end:
            result = end.value
            break
        if produced is not None:
            produced.append(token)
        piece = streamer.put(token)
        if piece:
            yield piece
    tail = streamer.end()
    if tail:
        yield tail
    return result


# ----------------------------------------------------------------------------------------------------------
# Chat
# ----------------------------------------------------------------------------------------------------------

CHAT_HELP = """commands:
  /reset              forget the conversation
  /temperature T      sampling temperature (0 = greedy)
  /top_k K            sample among the K most probable tokens (/top_k off to disable)
  /top_p P            nucleus sampling, P in (0, 1] (/top_p off to disable)
  /max_new_tokens N   longest reply, in tokens
  /help               this help
Ctrl-D exits."""


class ChatSession:
    """A conversation with a model: each turn continues the token history of the previous ones.

    For a model trained on prompt/response pairs (``pairs=True``, the lesson's task) the user's text is
    followed by ``<EOS>`` as in the lesson ("what is statquest <EOS>" -> "awesome <EOS>"); every reply stops
    at ``<EOS>`` (when the tokenizer has one), which stays in the history as the separator between turns.
    The model sees the last max_len tokens of the history (the window rule of :func:`stream`).

    Args:
        model, tokenizer: e.g. from ``load_checkpoint``.
        pairs: the model was trained on prompt/response pairs.
        temperature: default 0 (greedy, as the lesson) for pairs, 1.0 otherwise; top_k, top_p as in
            :func:`stream`; max_new_tokens: default max_len for pairs, 200 otherwise.
        seed: seeds turn i's sampling with seed + i (None: fresh entropy).

    ``reply(text)`` yields the reply as text pieces while it is generated; ``command(line)`` runs a
    "/command" and returns its message (or None when ``line`` is not a command).
    """

    def __init__(self, model, tokenizer, *, pairs: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, max_new_tokens: int | None = None,
                 seed: int | None = None):
        self.model, self.tokenizer, self.pairs = model, tokenizer, pairs
        self.temperature = (0.0 if pairs else 1.0) if temperature is None else temperature
        self.top_k, self.top_p = top_k, top_p
        self.max_new_tokens = (model.config.max_len if pairs else 200) if max_new_tokens is None else max_new_tokens
        check_sampling(self.temperature, self.top_k, self.top_p)
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        self.seed = seed
        self.turn = 0
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = []
        self.turn = 0

    def reply(self, text: str) -> Iterator[str]:
        tok = self.tokenizer
        eos = tok.eos_id
        ids = tok.encode(text)
        if self.pairs:
            if eos is None:
                raise ValueError("a model trained on prompt/response pairs needs a tokenizer with <EOS>")
            if not ids or ids[-1] != eos:
                ids.append(eos)
        history = self.history + ids
        seed = None if self.seed is None else self.seed + self.turn
        gen = stream(self.model, history, self.max_new_tokens, self.temperature, self.top_k, self.top_p,
                     stop=None if eos is None else [eos], seed=seed, tokenizer=tok)
        produced: list[int] = []
        matched = yield from _text_pieces(tok, gen, produced)
        history += produced + (list(matched) if matched else [])
        self.history = history[-self.model.config.max_len :]  # all the model can see
        self.turn += 1

    def command(self, line: str) -> str | None:
        line = line.strip()
        if not line.startswith("/"):
            return None
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        try:
            if name == "help":
                return CHAT_HELP
            if name == "reset":
                self.reset()
                return "(conversation reset)"
            if name == "temperature":
                t = float(arg)
                check_sampling(t, self.top_k, self.top_p)
                self.temperature = t
                return f"(temperature = {t:g})"
            if name in ("top_k", "top_p"):
                if arg.lower() in ("off", "none", ""):
                    setattr(self, name, None)
                    return f"({name} off)"
                value = int(arg) if name == "top_k" else float(arg)
                check_sampling(self.temperature, value if name == "top_k" else self.top_k,
                               value if name == "top_p" else self.top_p)
                setattr(self, name, value)
                return f"({name} = {value:g})"
            if name == "max_new_tokens":
                self.max_new_tokens = _check_int("max_new_tokens", int(arg), 0)
                return f"(max_new_tokens = {self.max_new_tokens})"
        except (ValueError, TypeError) as e:
            return f"error: /{name} {arg!r}: {e}"
        return f"unknown command /{name}; type /help"
