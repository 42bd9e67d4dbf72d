"""The inference engine: one loop (``_steps``) behind ``generate``, ``stream`` and ``generate_batch``.

Inference lives apart from the model (as nanochat's engine apart from its gpt.py): the model only knows how
to run a forward pass over new tokens with an optional ``KVCache`` (``model(ids, cache=...)``), and a lean
one-token step over the same blocks (``model.decode``).

One engine (``_steps``) serves every entry point. It runs B rows at once (B = 1 for ``generate`` and
``stream``), each row with its own *context window* ``ids[start:]`` of at most max_len tokens:

* with the cache, the window is prefilled once (left-padded to a common length for B > 1, with a padding mask
  and per-row positions so that every row starts at position 0), then each new token is one forward pass
  of one token per row;
* without the cache (``use_cache=False``, the lesson's loop), every step runs the whole window of each row
  through the model and keeps the last position's logits.

Both follow the same window rule (``_slide``), which is what keeps them exactly equal.
"""

from __future__ import annotations

from typing import Generator, Iterator, Sequence

import torch

from ..attention import KVCache
from ..hooks import use_hooks
from .sampling import Sampler, as_scalar, check_int, is_integer, make_generators
from .stops import Stops, parse_stops, text_decoder


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
            ids = [as_scalar(i) for i in prompt_ids]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of token ids, got {type(prompt_ids).__name__}") from None
    for i in ids:
        if not is_integer(i):
            raise TypeError(f"{name} must hold integer token ids, got {i!r}")
    ids = [int(i) for i in ids]
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


def _check_keep(keep, max_len: int) -> int:
    if keep is None:
        return default_keep(max_len)
    keep = check_int("keep", keep, 1)
    if keep > max_len:
        raise ValueError(f"keep must be in 1 .. max_len={max_len}, got {keep}")
    return keep


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
            logits = model(tokens, positions=(ar - p).clamp_min(0), padding_mask=pad_buf[:, :t], cache=cache,
                           last_only=True)
        else:
            state["pads"] = None
            logits = model(tokens, cache=cache, last_only=True)
        return logits[:, -1]  # (B, num_tokens): the output layer ran on the last position only

    def decode(next_ids: torch.Tensor) -> torch.Tensor:
        tokens = next_ids.view(b, 1)
        p = state["pads"]
        length = cache.length
        if p is None:
            return model.decode(tokens, length, None, cache)
        return model.decode(tokens, length - p, pad_buf[:, : length + 1], cache)

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


def _prepare(model, max_new_tokens, temperature, top_k, top_p, stop, tokenizer, keep, suppress_tokens,
             stop_at_eos) -> tuple[int, Sampler, Stops, int]:
    """Check the arguments every entry point shares; returns (max_new_tokens, sampler, stops, keep)."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    if suppress_tokens is None:
        pad = getattr(tokenizer, "pad_id", None) if tokenizer is not None else None
        suppress_tokens = () if pad is None else (pad,)
    elif isinstance(suppress_tokens, torch.Tensor):
        suppress_tokens = suppress_tokens.flatten().tolist()
    v = model.config.num_tokens
    suppress = [check_int("suppress_tokens id", i, 0) for i in suppress_tokens]
    bad = [i for i in suppress if i >= v]
    if bad:
        raise ValueError(f"suppress_tokens: token id {bad[0]} is out of range; allowed ids are 0 .. {v - 1}")
    sampler = Sampler(temperature, top_k, top_p, suppress=suppress)
    seqs, texts = parse_stops(stop, tokenizer, v)
    if not isinstance(stop_at_eos, bool):
        raise TypeError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    eos = getattr(tokenizer, "eos_id", None) if tokenizer is not None and stop_at_eos else None
    if eos is not None and (eos,) not in seqs:
        seqs.append((eos,))
    decode = text_decoder(tokenizer) if texts else None
    return max_new_tokens, sampler, (seqs, texts, decode), _check_keep(keep, model.config.max_len)


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
           keep: int | None = None, *, suppress_tokens=None,
           stop_at_eos: bool = True) -> Generator[int, None, tuple[int, ...] | None]:
    """Generate tokens one at a time, yielding each id as soon as it is known (the streaming ``generate``).

    Args:
        model: a ``DecoderOnlyTransformer`` (any dtype/device; it is put in eval mode for the call and its
            training flag restored afterwards).
        prompt_ids: the prompt, (T,) token ids (list, tuple or 1-D tensor), or text when ``tokenizer`` is
            given. An empty prompt starts from the tokenizer's ``<EOS>`` (the start token of decoderlab's
            models, which put ``<EOS>`` between texts); without a tokenizer that has one it is an error.
        max_new_tokens: the most tokens to produce (0 -> nothing). Tokens swallowed by a stop sequence count.
        temperature: 0 -> greedy (argmax); otherwise the logits are divided by it before sampling.
        top_k: sample only among the k most probable tokens (k larger than the vocabulary is clamped);
            0 or None: no top-k filter.
        top_p: sample only among the smallest set of most probable tokens whose probability reaches top_p.
            Numbers of any kind are accepted (Python, NumPy, 0-d tensors).
        stop: where to stop, before emitting it: a token id; a tuple of ids (one multi-token sequence); a
            string, which is matched on the decoded **text** of the generated tokens, however the model
            spells it (``"\n\n"`` stops at one ``"\n\n"`` token or at two ``"\n"`` tokens), except that a
            string naming a control token of the tokenizer (``"<EOS>"``) is that token; or a list of any of
            these. What could still become a stop is held back until it is clear it does not. When a stop
            string begins inside a token, the ids end before that token (the text before the stop inside
            it is in no returned id; :func:`stream_text` writes it, ending exactly before the stop).
        seed: seeds the ``torch.Generator`` used for sampling (the global RNG is never touched); the same
            seed gives the same tokens, with or without the cache. None -> fresh entropy.
        use_cache: True (default) prefills a KV cache once and then runs one token per forward pass; False is
            the lesson's loop (the whole window through the model for every token). Both give the same tokens.
        tokenizer: needed for stop strings, text prompts and the empty-prompt start token. It also names the
            control tokens: with a tokenizer, its ``<PAD>`` is never sampled and its ``<EOS>`` ends generation
            (see ``suppress_tokens`` and ``stop_at_eos``).
        keep: tokens kept when the context window slides (default max_len // 2; see below).
        suppress_tokens: token ids never to generate (their logits are -inf, also when greedy). Default: the
            tokenizer's ``<PAD>``, a token a language model never sees as a target; ``()`` suppresses none.
        stop_at_eos: with a tokenizer that has ``<EOS>`` (the end of a text), generation ends when the model
            produces it, as a stop (not yielded; as Hugging Face's ``generate`` ends at ``eos_token_id``).
            False lets ``<EOS>`` through as an id.

    The context window: the model sees at most max_len tokens. A prompt longer than that is cut to its last
    max_len tokens. When the window (prompt plus generated tokens) would pass max_len, it restarts on its
    last ``keep`` tokens and keeps growing from there -- with the cache, by recomputing (re-prefilling) the
    cache for that cropped window, for every position kind (learned, sinusoidal, rope, none), since cached
    keys carry their old positions. With the default ``keep = max_len // 2`` the re-prefill costs about one
    extra forward token per generated token; ``keep = max_len`` reproduces nanoGPT's crop-every-step (each
    step then re-prefills max_len tokens). The uncached loop applies exactly the same rule, so the two stay
    equal token for token.

    Yields:
        token ids (ints). The generator's return value (``StopIteration.value``) is None when generation
        ended without a stop; after a stop, the tuple of generated ids that were not yielded: the stop
        sequence for a token-id stop (``(eos_id,)`` at ``<EOS>``), and for a stop string the tokens that
        spelled it, from the first one not yielded.

    Raises:
        ValueError: max_new_tokens < 0; temperature < 0, NaN or infinite; top_k < 0; top_p outside (0, 1];
            prompt, stop or suppressed ids out of range; an empty prompt with no start token; a stop string
            the tokenizer cannot encode; keep outside 1 .. max_len. While generating: the model's logits hold
            NaN, or every token of a step is suppressed or filtered out.
        TypeError: values of the wrong type; a stop string without a tokenizer.

    All arguments are checked at the call, before the first token is asked for.
    """
    ids, args = _prepare_one(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, tokenizer,
                             keep, suppress_tokens, stop_at_eos)
    return _stream_one(model, ids, *args, use_cache=use_cache)


def _prepare_one(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, tokenizer, keep,
                 suppress_tokens, stop_at_eos):
    n, sampler, (seqs, texts, decode), keep = _prepare(model, max_new_tokens, temperature, top_k, top_p, stop,
                                                       tokenizer, keep, suppress_tokens, stop_at_eos)
    ids = _prompt_list(model, prompt_ids, tokenizer)
    gens = [] if sampler.greedy else make_generators(seed, 1, _model_device(model))
    return ids, (n, sampler, gens, keep, Stops(seqs, texts, decode))


def _stream_one(model, ids, max_new_tokens, sampler, gens, keep, stops, *, use_cache):
    for (token,) in _stream_rows(model, [ids], max_new_tokens, sampler, gens, use_cache, keep):
        out, matched = stops.push(token)
        yield from out
        if matched is not None:
            return matched
    yield from stops.flush()
    return None


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, stop=None, seed=None, use_cache: bool = True, tokenizer=None,
             keep: int | None = None, *, suppress_tokens=None, stop_at_eos: bool = True, hooks=()) -> list[int]:
    """Continue a prompt: returns the new token ids (not the prompt, not a matched stop).

    Same arguments, context-window rule and errors as :func:`stream` (this is ``list(stream(...))``). With a
    stop string the ids end before the token in which the stop begins: a token holding text before the stop
    and the start of the stop (``"a\n"`` before ``"\n"``, stop ``"\n\n"``) is not returned.
    ``hooks``: pairs ``(hook name, fn)`` installed on the model's hook points for the call (every prefill
    and decode step; :mod:`decoderlab.hooks`), e.g. a steering vector from ``decoderlab.glassbox.steering``.
    Source: the KV cache as in nanoGPT/nanochat's engines; top-p from Holtzman et al. 2019.
    """
    with use_hooks(model, hooks):
        return list(stream(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, use_cache,
                           tokenizer, keep, suppress_tokens=suppress_tokens, stop_at_eos=stop_at_eos))


def generate_batch(model, prompts: Sequence, max_new_tokens: int, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None, stop=None, seed=None,
                   use_cache: bool = True, tokenizer=None, keep: int | None = None, *, suppress_tokens=None,
                   stop_at_eos: bool = True) -> list[list[int]]:
    """Continue several prompts of different lengths at once; returns the new ids of each prompt.

    The prompts are left-padded to a common length; a padding mask hides the padded keys and each row gets
    its own positions, so every prompt starts at position 0 exactly as when generated alone. Each row follows
    its own context window (the rule of :func:`stream`); when a row's window slides, or the shared cache is
    full, the cache is re-prefilled with every row's current window. A row that hits a stop (token ids, a stop
    string in its text, or the tokenizer's ``<EOS>``) is done (the others go on); the call ends when all rows
    are done or after max_new_tokens steps.

    Sampling: every row has its own ``torch.Generator``. ``seed`` an int seeds each row's generator with that
    same int, so row i gives the same tokens as ``generate(model, prompts[i], ..., seed=seed)`` (and equal
    prompts give equal samples); a list of ints seeds row i with ``seed[i]``; None draws fresh entropy.

    Args: as :func:`stream`, with ``prompts`` a list of prompts (token-id sequences, or texts with a tokenizer).

    Raises: as :func:`stream`; ValueError for an empty list of prompts or a seed list of the wrong length.
    """
    max_new_tokens, sampler, (seqs, texts, decode), keep = _prepare(
        model, max_new_tokens, temperature, top_k, top_p, stop, tokenizer, keep, suppress_tokens, stop_at_eos)
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a text)")
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    rows = [_prompt_list(model, p, tokenizer, name=f"prompts[{i}]") for i, p in enumerate(prompts)]
    gens = [] if sampler.greedy else make_generators(seed, len(rows), _model_device(model))
    matchers = [Stops(seqs, texts, decode) for _ in rows]
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
