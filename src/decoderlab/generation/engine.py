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

from typing import Generator, Sequence

import torch

from ..attention import KVCache
from ..hooks import use_hooks
from ..tokenizers import encode_with_special_tokens
from .checks import as_scalar, check_int, is_integer
from .params import BoundParams, SamplingParams
from .processors import TokenCounts
from .sampling import Sampler, make_generator
from .stops import Stops


def default_keep(max_len: int) -> int:
    """Tokens kept when the context window slides: max_len // 2 (at least 1)."""
    return max(1, max_len // 2)


def _slide(n: int, start: int, max_len: int, keep: int) -> int:
    """The context-window rule shared by the cached and the uncached loop.

    A row of n tokens whose window ``ids[start:]`` has grown past max_len restarts on its last ``keep``
    tokens; otherwise the window keeps growing.
    """
    return n - keep if n - start > max_len else start


def model_device(model) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def check_prompt(model, prompt_ids, tokenizer=None, name: str = "prompt_ids") -> list[int]:
    """A prompt as a list of token ids, checked against the model's vocabulary: ids as a list/tuple/1-D tensor,
    taken as given, or text when a tokenizer is given, encoded with the start token its tokenizer puts first
    (:func:`~decoderlab.tokenizers.encode_with_special_tokens`: Llama's ``<s>``, as transformers and vLLM
    encode a prompt). An empty prompt starts from the tokenizer's ``<EOS>``.

    Raises:
        TypeError: bytes (say text or ids); text without a tokenizer; not a sequence of integer ids.
        ValueError: a float/bool or 2-D tensor; an id out of range; an empty prompt and no start token.
    """
    if isinstance(prompt_ids, (bytes, bytearray)):
        raise TypeError(f"{name} is bytes ({bytes(prompt_ids[:30])!r}); pass text (a str, decoded) or a list of "
                        f"token ids")
    if isinstance(prompt_ids, str):
        if tokenizer is None:
            raise TypeError(f"{name} is text ({prompt_ids[:30]!r}); pass token ids, or the tokenizer to encode it")
        prompt_ids = encode_with_special_tokens(tokenizer, prompt_ids)
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


def check_keep(keep, max_len: int) -> int:
    """Tokens kept when a window slides: None -> :func:`default_keep`; else an integer in 1 .. max_len."""
    if keep is None:
        return default_keep(max_len)
    keep = check_int("keep", keep, 1)
    if keep > max_len:
        raise ValueError(f"keep must be in 1 .. max_len={max_len}, got {keep}")
    return keep


class _Windows:
    """The B rows of one engine call and how their next logits are computed: each row's context window
    ``rows[i][starts[i]:]``, the KV cache (allocated once, re-prefilled when a window slides) and the padding
    of the current prefill -- or, without the cache, the lesson's loop over the whole windows."""

    def __init__(self, model, rows: list[list[int]], use_cache: bool, keep: int):
        self.model, self.rows, self.keep = model, rows, keep
        self.b, self.max_len = len(rows), model.config.max_len
        self.device = model_device(model)
        self.starts = [max(0, len(r) - self.max_len) for r in rows]
        # a compiled step (model.compile_decode) decodes over a static cache: one graph for the whole context
        self.step = getattr(model, "compiled_decode", None)
        self.static = self.step is not None
        if self.step is None:
            self.step = model.decode
        # a step that reads the written columns only (the AOT step's window) needs no zeroed cache
        zero = not getattr(self.step, "reads_written_only", False)
        self.cache = KVCache.for_model(model, static=self.static, zero_unwritten=zero) if use_cache else None
        self.pad_buf = torch.zeros(self.b, self.max_len, dtype=torch.bool, device=self.device)
        self.pads: torch.Tensor | None = None  # (B, 1) pad counts of the current prefill; None: no row padded

    def first(self) -> torch.Tensor:
        """(B, num_tokens) logits of every row's next token after its prompt."""
        return self.prefill() if self.cache is not None else self.full()

    def after(self, next_ids: torch.Tensor) -> torch.Tensor:
        """The next logits once ``next_ids`` (B,) were appended to the rows (windows slide as they must)."""
        slid = False
        for i, r in enumerate(self.rows):
            s = _slide(len(r), self.starts[i], self.max_len, self.keep)
            slid |= s != self.starts[i]
            self.starts[i] = s
        if self.cache is None:
            return self.full()
        if slid or self.cache.length + 1 > self.max_len:
            return self.prefill()
        return self.decode(next_ids)

    def prefill(self) -> torch.Tensor:
        """(B, num_tokens) logits after each row's window, its KV cache written. Rows with the same window (the
        samples of one prompt) are computed once and their cache rows copied (not over a static cache)."""
        windows = [r[s:] for r, s in zip(self.rows, self.starts)]
        t = max(len(w) for w in windows)
        pads = [t - len(w) for w in windows]
        firsts: dict[tuple, int] = {}
        slot = [firsts.setdefault(tuple(w), len(firsts)) for w in windows]
        unique = list(range(self.b)) if self.static or len(firsts) == self.b else _first_rows(slot)
        tokens = torch.tensor([[0] * pads[i] + windows[i] for i in unique], dtype=torch.long, device=self.device)
        self.cache.reset()
        # the ids were checked on the host (check_prompt) or sampled from the vocabulary: no range check, which
        # would wait for the device; the output layer runs on the last position only
        if not any(pads):
            self.pads = None
            logits = self.model(tokens, cache=self.cache, last_only=True, check_ids=False)[:, -1]
        else:
            p = torch.tensor(pads, device=self.device).unsqueeze(1)  # (B, 1)
            ar = torch.arange(t, device=self.device).unsqueeze(0)
            self.pad_buf.zero_()
            self.pad_buf[:, :t] = ar < p
            self.pads = p
            # the positions follow from the padding mask (each token's index among its row's real ones)
            mask = self.pad_buf[:, :t] if len(unique) == self.b else self.pad_buf[unique, :t]
            logits = self.model(tokens, padding_mask=mask, cache=self.cache, last_only=True, check_ids=False)[:, -1]
        if len(unique) == self.b:
            return logits
        idx = torch.tensor(slot, device=self.device)
        self.cache.keep_rows(idx)  # each row's copy of its window's cache rows
        return logits.index_select(0, idx)

    def decode(self, next_ids: torch.Tensor) -> torch.Tensor:
        tokens = next_ids.view(self.b, 1)
        cache, length = self.cache, self.cache.length
        if self.static:  # tensors of fixed shapes only: the column to write lives on the device
            positions = cache.column if self.pads is None else cache.column - self.pads
            mask = None if self.pads is None else self.pad_buf
        elif self.pads is None:
            positions, mask = length, None
        else:
            positions, mask = length - self.pads, self.pad_buf[:, : length + 1]
        logits = self.step(tokens, positions, mask, cache)
        cache.advance(1)
        return logits

    def retire(self, keep: list[int]) -> bool:
        """Keep only the rows ``keep`` (indices, ascending) of the batch -- their windows, cache rows and
        padding -- so rows that are done stop costing a step. False (nothing changed) over a compiled step's
        static cache, whose shapes are fixed."""
        if self.static:
            return False
        idx = torch.tensor(keep, device=self.device)
        self.rows[:] = [self.rows[k] for k in keep]  # (the engine's own list, shared with _steps)
        self.starts, self.b = [self.starts[k] for k in keep], len(keep)
        self.pad_buf = self.pad_buf.index_select(0, idx)
        if self.pads is not None:
            self.pads = self.pads.index_select(0, idx)
        if self.cache is not None:
            self.cache.keep_rows(idx)
        return True

    def full(self) -> torch.Tensor:  # the lesson's loop: the whole window, every step
        rows, starts, device = self.rows, self.starts, self.device
        if self.b == 1:
            return self.model(torch.tensor([rows[0][starts[0]:]], dtype=torch.long, device=device),
                              check_ids=False)[:, -1]
        groups: dict[int, list[int]] = {}  # rows whose windows have the same length run as one batch
        for i, (r, s) in enumerate(zip(rows, starts)):
            groups.setdefault(len(r) - s, []).append(i)
        out = [None] * self.b
        for members in groups.values():
            tokens = torch.tensor([rows[i][starts[i]:] for i in members], dtype=torch.long, device=device)
            for i, row_logits in zip(members, self.model(tokens, check_ids=False)[:, -1]):
                out[i] = row_logits
        return torch.stack(out)


def _first_rows(slot: list[int]) -> list[int]:
    """The first row of each distinct window, in slot order (``slot[i]``: row i's window's number)."""
    first: dict[int, int] = {}
    for i, s in enumerate(slot):
        first.setdefault(s, i)
    return [first[s] for s in range(len(first))]


def _steps(model, rows: list[list[int]], max_new_tokens: int, sampler: Sampler,
           generators: list[torch.Generator | None], counts: TokenCounts | None, use_cache: bool,
           keep: int) -> Generator[list[int], list[int] | None, None]:
    """The engine: yields, per step, the B next token ids; ``rows`` (lists of ids) are extended in place and
    ``counts`` (the penalties' state, when a penalty is on) counts each step's tokens.

    The caller may ``send`` the indices of the rows to keep (ascending) instead of asking for the next step:
    the others leave the batch -- their cache rows, generators and counts (:meth:`TokenCounts.keep`, in place)
    -- and later steps yield the kept rows' ids only. Over a compiled step's static cache the batch stays whole
    and yields every row (the caller sees its B ids and ignores the rows it is done with).

    Runs under ``torch.inference_mode`` for the caller (see the decorated callers) with the model in eval
    mode. The KV cache is allocated once and reused (re-prefilled) when a window slides.
    """
    if max_new_tokens == 0:
        return
    rows = list(rows)  # (retiring rows narrows this list, never the caller's)
    windows = _Windows(model, rows, use_cache, keep)
    logits = windows.first()
    for step in range(max_new_tokens):
        next_ids = sampler.choose(logits, generators, counts)
        new = next_ids.tolist()  # the step's one wait for the device: the host needs the ids
        sampler.check(new, logits, counts)  # a row with no token to choose raises here, from the host copy
        if counts is not None:
            counts.add(next_ids)
        for r, t in zip(rows, new):
            r.append(t)
        kept = yield new
        if step == max_new_tokens - 1:
            return
        if kept is not None and windows.retire(kept):
            next_ids = next_ids.index_select(0, torch.tensor(kept, device=next_ids.device))
            sampler = Sampler([sampler.rows[k] for k in kept]) if sampler.per_row else sampler
            generators = [generators[k] for k in kept] if generators else generators
            if counts is not None:
                counts.keep(kept)
        logits = windows.after(next_ids)


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
def _stream_rows(model, rows, max_new_tokens, sampler, generators, counts, use_cache, keep):
    # a decorated generator: inference mode is entered and left around each step, never leaking to the caller
    with _EvalMode(model):
        yield from _steps(model, rows, max_new_tokens, sampler, generators, counts, use_cache, keep)


def prepare(model, prompt_ids, params, tokenizer, keep, sampling: dict) -> tuple[list[int], BoundParams, int]:
    """The checks every single-prompt entry point makes, at the call: ``(prompt ids, bound params, keep)``.

    ``params`` and ``sampling`` as :meth:`SamplingParams.of` takes them (the one place settings are checked),
    bound to the model's vocabulary and ``tokenizer``; the prompt by :func:`check_prompt`; ``keep`` by
    :func:`check_keep`."""
    bound = SamplingParams.of(params, **sampling).bind(model.config.num_tokens, tokenizer)
    ids = check_prompt(model, prompt_ids, tokenizer)
    return ids, bound, check_keep(keep, model.config.max_len)


def stream_tokens(model, ids: list[int], bound: BoundParams, stops: Stops, *, use_cache: bool = True,
                  keep: int) -> Generator[int, None, tuple[int, ...] | None]:
    """The token stream of checked arguments (:func:`prepare`): the ids ``stops`` lets through, as
    :func:`stream` yields them, returning what a stop swallowed (or None). ``ids`` is extended in place with
    every generated token; ``stops`` keeps the text a stop string left inside its first token (``tail``)."""
    params = bound.params
    sampler = Sampler(params)
    device = model_device(model)
    gens = [] if sampler.greedy else [make_generator(params.seed, device)]
    counts = (TokenCounts.for_prompts([ids], model.config.num_tokens, device, grammars=[bound.grammar])
              if sampler.uses_counts else None)
    for (token,) in _stream_rows(model, [ids], params.max_new_tokens, sampler, gens, counts, use_cache, keep):
        out, matched = stops.push(token)
        yield from out
        if matched is not None:
            return matched
        if counts is not None and counts.complete(0):  # the grammar allows no more text: a stop that took nothing
            yield from stops.flush()
            return ()
    yield from stops.flush()
    return None


def stream(model, prompt_ids, params: SamplingParams | int | None = None, *, tokenizer=None,
           use_cache: bool = True, keep: int | None = None,
           **sampling) -> Generator[int, None, tuple[int, ...] | None]:
    """Generate tokens one at a time, yielding each id as soon as it is known (the streaming ``generate``).

    Args:
        model: a ``DecoderOnlyTransformer`` (any dtype/device; it is put in eval mode for the call and its
            training flag restored afterwards).
        prompt_ids: the prompt, (T,) token ids (list, tuple or 1-D tensor), or text when ``tokenizer`` is
            given (bytes are refused; the text gets the start token the tokenizer puts first, as
            ``transformers``' ``tokenizer(text)``: :func:`check_prompt`). An empty prompt starts from the
            tokenizer's ``<EOS>`` (the start token of decoderlab's models, which put ``<EOS>`` between texts);
            without a tokenizer that has one it is an error.
        params: a :class:`SamplingParams` (every setting: max_new_tokens, temperature, top_k, top_p, min_p,
            penalties, logit_bias, suppress_tokens, stop, stop_at_eos, seed), or an int, short for
            ``max_new_tokens``; None: the defaults.
        **sampling: SamplingParams fields, applied over ``params``
            (``stream(model, ids, 50, temperature=0)`` is ``stream(model, ids, SamplingParams(max_new_tokens=50,
            temperature=0))``).
        tokenizer: needed for stop strings, text prompts and the empty-prompt start token. It also names the
            control tokens: with a tokenizer, its ``<PAD>`` is never sampled and its end-of-text tokens
            (``<EOS>``, a chat template's end of turn) end generation (``suppress_tokens``, ``stop_at_eos``).
        use_cache: True (default) prefills a KV cache once and then runs one token per forward pass; False is
            the lesson's loop (the whole window through the model for every token). Both give the same tokens.
        keep: tokens kept when the context window slides (default max_len // 2; see below).

    Stops are matched where the user thinks of them: token ids on ids; a stop string on the decoded **text**
    of the generated tokens, however the model spells it (``"\\n\\n"`` stops at one ``"\\n\\n"`` token or
    at two ``"\\n"`` tokens). What could still become a stop is held back until it is clear it does not. When
    a stop string begins inside a token, the ids end before that token (:func:`stream_text` writes the text
    before the stop inside it). The seed seeds a ``torch.Generator`` (the global RNG is never touched): the
    same seed gives the same tokens, with or without the cache.

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
        spelled it, from the first one not yielded; ``()`` when a grammar (``grammar=``, ``json_schema=``)
        allowed no more text.

    Raises:
        ValueError / TypeError: a bad setting (see :class:`SamplingParams`); prompt, stop, suppressed or
            biased ids out of range; an empty prompt with no start token; a stop string the tokenizer cannot
            encode, or without a tokenizer; keep outside 1 .. max_len. While generating: the model's logits
            hold NaN, or every token of a step is suppressed or filtered out.

    All arguments are checked at the call, before the first token is asked for.
    """
    ids, bound, keep = prepare(model, prompt_ids, params, tokenizer, keep, sampling)
    return stream_tokens(model, ids, bound, bound.stops(), use_cache=use_cache, keep=keep)


def generate(model, prompt_ids, params: SamplingParams | int | None = None, *, tokenizer=None,
             use_cache: bool = True, keep: int | None = None, hooks=(), **sampling) -> list[int]:
    """Continue a prompt: returns the new token ids (not the prompt, not a matched stop).

    Same arguments, context-window rule and errors as :func:`stream` (this is ``list(stream(...))``):
    ``generate(model, ids, 50, temperature=0)``, or ``generate(model, ids, SamplingParams(...))``. With a stop
    string the ids end before the token in which the stop begins: a token holding text before the stop and
    the start of the stop (``"a\\n"`` before ``"\\n"``, stop ``"\\n\\n"``) is not returned.
    ``hooks``: pairs ``(hook name, fn)`` installed on the model's hook points for the call (every prefill
    and decode step; :mod:`decoderlab.hooks`), e.g. a steering vector from ``decoderlab.glassbox.steering``.
    Source: the KV cache as in nanoGPT/nanochat's engines; top-p from Holtzman et al. 2019.
    """
    with use_hooks(model, hooks):
        return list(stream(model, prompt_ids, params, tokenizer=tokenizer, use_cache=use_cache, keep=keep,
                           **sampling))


def batch_params(params, n: int, sampling: dict) -> list[SamplingParams]:
    """The settings of each of ``n`` rows: ``params`` a SamplingParams / int / None shared by every row, or a
    sequence of n SamplingParams (one per row); ``sampling`` fields applied to every row, where ``seed`` may
    also be a sequence of n seeds (one per row).

    Raises: ValueError for a sequence of the wrong length; what :class:`SamplingParams` raises."""
    sampling = dict(sampling)
    seeds = sampling.get("seed")
    if isinstance(seeds, torch.Tensor) and seeds.dim() == 1:
        seeds = seeds.tolist()
    per_row_seed = isinstance(seeds, Sequence) and not isinstance(seeds, (str, bytes))
    if per_row_seed:
        del sampling["seed"]
        if len(seeds) != n:
            raise ValueError(f"seed must be an int or one int per prompt ({n}), got {len(seeds)} seeds")
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != n:
            raise ValueError(f"params must be one SamplingParams or one per prompt ({n}), got {len(params)}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be a SamplingParams, got {type(p).__name__}")
        rows = [SamplingParams.of(p, **sampling) for p in params]
    else:
        rows = [SamplingParams.of(params, **sampling)] * n
    if per_row_seed:
        rows = [p.replace(seed=s) for p, s in zip(rows, seeds)]
    return rows


def generate_batch(model, prompts: Sequence, params=None, *, tokenizer=None, use_cache: bool = True,
                   keep: int | None = None, return_stops: bool = False, **sampling) -> list:
    """Continue several prompts of different lengths at once; returns the new ids of each prompt (with
    ``return_stops``, ``(ids, stop)`` pairs: ``stop`` what :func:`stream` returns for that row -- the matched
    stop's tokens, ``()`` for a complete grammar, None at the token limit).

    The prompts are left-padded to a common length; a padding mask hides the padded keys and each row gets
    its own positions, so every prompt starts at position 0 exactly as when generated alone. Each row follows
    its own context window (the rule of :func:`stream`); when a row's window slides, or the shared cache is
    full, the cache is re-prefilled with every row's current window. A row that hits a stop (token ids, a stop
    string in its text, or an end-of-text token) or its own ``max_new_tokens`` is done (the others go on); once a
    quarter of the rows still stepped are done they leave the batch, so a batch of short and long replies costs
    about what its rows' own lengths cost; the call ends when all rows are done. Rows with the same prompt (k
    samples of one) are prefilled once, their KV cache rows copied.

    Settings: ``params`` one :class:`SamplingParams` (or an int, short for max_new_tokens) for every row, or a
    list of one per prompt -- every row has its own settings, penalties' counts and ``torch.Generator``, so
    row i gives the same tokens as ``generate(model, prompts[i], params[i])``. A ``seed=`` keyword may be one
    int (every row seeded with it, so equal prompts give equal samples) or one per prompt.

    Args: as :func:`stream`, with ``prompts`` a list of prompts (token-id sequences, or texts with a tokenizer).

    Raises: as :func:`stream`; ValueError for an empty list of prompts, or a list of seeds or params of the
    wrong length.
    """
    if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts (each a list of token ids or a text)")
    rows_params = batch_params(params, len(prompts), sampling)
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    v = model.config.num_tokens
    bound_of: dict[SamplingParams, BoundParams] = {}  # rows with equal settings are bound once
    for p in rows_params:
        if p not in bound_of:
            bound_of[p] = p.bind(v, tokenizer)
    bounds = [bound_of[p] for p in rows_params]
    rows = [check_prompt(model, p, tokenizer, name=f"prompts[{i}]") for i, p in enumerate(prompts)]
    keep = check_keep(keep, model.config.max_len)
    outs, ends = _run_batch(model, rows, bounds, use_cache, keep)
    return list(zip(outs, ends)) if return_stops else outs


#: the share of the rows still stepped that must be done before they leave generate_batch's batch (each leaving
#: copies the kept rows' KV cache once; a step then costs what the rows still running cost)
RETIRE_SHARE = 0.25


def _run_batch(model, rows: list[list[int]], bounds: list[BoundParams], use_cache: bool,
               keep: int) -> tuple[list[list[int]], list]:
    """generate_batch's loop over checked arguments: each row through its own stops and token limit; returns
    each row's ids and how it ended (:func:`stream`'s return value). Once a
    quarter of the rows still stepped are done (:data:`RETIRE_SHARE`), they leave the batch (``_steps``'
    ``send``): replies of mixed lengths no longer cost every row the longest one's steps."""
    device = model_device(model)
    sampler = Sampler([b.params for b in bounds])
    gens = [] if sampler.greedy else [None if b.params.greedy else make_generator(b.params.seed, device)
                                      for b in bounds]
    counts = (TokenCounts.for_prompts(rows, model.config.num_tokens, device, grammars=[b.grammar for b in bounds])
              if sampler.uses_counts else None)
    limits = [b.params.max_new_tokens for b in bounds]
    matchers = [b.stops() for b in bounds]
    outs: list[list[int]] = [[] for _ in rows]
    ends: list = [None] * len(rows)
    done = [n == 0 for n in limits]
    live = list(range(len(rows)))  # the original row of each row the engine still steps
    steps = _stream_rows(model, rows, max(limits), sampler, gens, counts, use_cache, keep)
    step, new = 1, next(steps, None)
    while new is not None:
        for pos, (i, t) in enumerate(zip(live, new)):
            if done[i]:
                continue
            emitted, ends[i] = matchers[i].push(t)
            outs[i].extend(emitted)
            done[i] = ends[i] is not None
            complete = not done[i] and counts is not None and counts.complete(pos)
            if complete or not done[i] and step == limits[i]:
                # its grammar is complete (stream's ``()``), or this row's own limit: what the stops hold is text
                outs[i].extend(matchers[i].flush())
                ends[i], done[i] = (() if complete else None), True
        if all(done):
            steps.close()
            break
        kept = [pos for pos, i in enumerate(live) if not done[i]]
        retire = (len(live) - len(kept)) >= RETIRE_SHARE * len(live)
        try:
            new = steps.send(kept if retire else None)
        except StopIteration:
            break
        if retire and len(new) == len(kept):  # (a compiled step's static cache keeps every row)
            live = [live[pos] for pos in kept]
        step += 1
    return outs, ends
