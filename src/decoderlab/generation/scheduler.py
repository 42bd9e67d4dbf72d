"""Continuous batching: many generation requests decoded together over one model's KV-cache forward pass.

One background thread owns the model. Requests wait in a bounded queue (:class:`QueueFull` when it is full);
between two decode steps the thread admits waiting requests into the running batch (newcomers' prompts are
prefilled together in one forward pass, as :func:`decoderlab.generate_batch` prefills them -- left-padded to
the longest, a padding mask hiding the pads and each row at its own positions; prompts of equal length need no
padding -- so a burst of requests waits for one prefill, not one each; their keys/values are copied into the
batch cache and their first token is sampled at once), then samples one token for every running row, releases the rows that finished or were
cancelled, and runs one decode step of one token per row for all the others together.

The batch cache (:class:`decoderlab.generation.batch_cache.BatchKVCache`, its own module) keeps every row's
keys/values right-aligned on one timeline, each row at its own positions behind a padding mask. A row whose
window would pass max_len slides as :func:`decoderlab.generation.stream` does: its last ``keep`` tokens are
re-prefilled alone.

Sampling: every row has its own settings (the request's :class:`decoderlab.generation.SamplingParams`), its
own ``torch.Generator`` (seeded with the request's seed; choice i of a request with ``n`` > 1 with seed + i)
and its own penalties' state (a :class:`decoderlab.generation.TokenCounts`). One
:class:`decoderlab.generation.Sampler` samples every running row together, its logits processors holding
per-row settings, and each sampled row draws exactly one uniform number per token, so a seeded request gives
the same tokens alone or batched with rows of other settings (up to float rounding of batched matmuls, which
the tests check does not change the tokens of small models).

Every row follows :func:`decoderlab.generate`'s rules with the same settings, through the same code: the
settings are checked once when the request's ``SamplingParams`` is built and bound to the model and
tokenizer by :meth:`~decoderlab.generation.SamplingParams.bind` (``<PAD>`` never sampled, the end-of-text
tokens -- ``<EOS>``, a chat template's end of turn -- end the text), and each row's stops are a
:class:`decoderlab.generation.stops.Stops` (token-id stops, and stop strings matched on the decoded text,
however it was tokenized, with what could still become a stop held back) whose emitted ids become text
through a :class:`decoderlab.generation.TextStreamer`, as :func:`decoderlab.generation.stream_text` does. So a
row's text is ``stream_text``'s text for the same prompt and settings.

Source: the continuous ("iteration-level") batching of Orca (Yu et al., OSDI 2022), as in vLLM's scheduler;
written here over decoderlab's own KV cache.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..attention import KVCache
from .batch_cache import BatchKVCache
from .checks import check_int
from .engine import check_keep, check_prompt, model_device
from .params import BoundParams, SamplingParams
from .processors import TokenCounts
from .sampling import Sampler
from .scoring import logprob_token
from .text import TextStreamer


def dynamic_int(n):
    """``n`` marked as a size ``torch.compile`` takes as dynamic from its first compile
    (``torch.fx.experimental.sym_node.DynamicInt``, an ``int`` everywhere else); ``n`` itself where it is not an
    int or torch has no such mark (an older torch: dynamo then makes it dynamic at its second value)."""
    try:
        from torch.fx.experimental.sym_node import DynamicInt
    except ImportError:
        return n
    return DynamicInt(n) if type(n) is int else n


class QueueFull(RuntimeError):
    """The scheduler's queue holds ``max_queue`` waiting requests already; retry later."""


class SchedulerClosed(RuntimeError):
    """The scheduler was shut down."""


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """One request: ``n`` continuations of ``prompt_ids``, each as :func:`decoderlab.generate` would give it with
    the same settings and the scheduler's tokenizer.

    Args:
        prompt_ids: the prompt's token ids (1 .. max_len of them; the caller checks the length).
        params: the settings of every choice (a :class:`decoderlab.generation.SamplingParams`, checked when
            built): ``max_new_tokens`` (>= 1 here) is the most tokens per choice, tokens cut by a stop
            counting; ``stop`` strings are matched on the decoded text and ids on the ids; the tokenizer's
            ``<PAD>`` is never sampled and its end-of-text tokens end a choice (``stop_at_eos``); choice i
            samples with a ``torch.Generator`` seeded with ``seed`` + i (None: fresh entropy).
        n: how many choices.
        logprobs: None, or how many most probable alternatives (0 .. 20) to report with each token's logprob.
        on_event: called from the scheduler thread with each event (a tuple):
            ``("delta", index, text, logprob_items)``, ``("finish", index, reason, stop)`` (reason "stop" or
            "length"; "cancelled" when cancelled; ``stop``: the ids of the stop that ended it, as vLLM's
            ``stop_reason`` -- an end-of-text id, a stop string's tokens -- or None), ``("done", usage_dict)`` last, or ``("error", exception)``.

    :meth:`Scheduler.submit` binds the settings to the model (``ValueError`` / ``TypeError`` as ``generate``).
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    logprobs: int | None = None
    on_event: Callable[[tuple], None] | None = None
    cancelled: bool = False
    completion_tokens: int = 0
    _open_rows: int = 0
    _bound: BoundParams | None = None

    def cancel(self) -> None:
        """Stop generating at the next token (a client hung up); the scheduler releases the rows."""
        self.cancelled = True

    def emit(self, event: tuple) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 -- a listener that is gone (closed event loop) ends only this request
                self.cancelled = True


class _Row:
    """One choice of a request while it runs."""

    def __init__(self, req: GenerationRequest, index: int, tokenizer, device, num_tokens: int):
        self.req, self.index = req, index
        self.params = req._bound.params
        self.ids = list(req.prompt_ids)  # prompt + generated, the window is ids[start:]
        self.start = 0
        self.produced = 0
        self.logits: torch.Tensor | None = None  # (V,) the next token's logits, when known
        self.slot = -1
        self.stops = req._bound.stops()  # token ids the stops release go to the streamer, as in stream_text
        self.streamer = TextStreamer(tokenizer)
        self.held_lp: collections.deque = collections.deque()  # logprob items of ids the stops hold back
        self.pending_lp: list[dict] = []  # ... of ids the streamer holds (an incomplete character)
        self.ready_lp: list[dict] = []  # ... of ids whose text is out, to send with it
        if self.params.greedy:
            self.gen = None
        else:
            self.gen = torch.Generator(device=device)
            if self.params.seed is None:
                self.gen.seed()
            else:
                self.gen.manual_seed(self.params.seed + index)  # torch takes up to 2**64-1
        self.counts = (TokenCounts.for_prompts([self.ids], num_tokens, device, grammars=[req._bound.grammar])
                       if self.params.uses_counts else None)  # the penalties' and the grammar's state of this row


class _Prefill:
    """A request whose long prompt is being prefilled chunk by chunk, alone, into its own KV cache."""

    def __init__(self, req: GenerationRequest, n_layer: int, max_len: int):
        self.req = req
        self.cache = KVCache(n_layer, max_len)
        self.done = 0  # prompt tokens in the cache


# ----------------------------------------------------------------------------------------------------------
# The scheduler
# ----------------------------------------------------------------------------------------------------------


class Scheduler:
    """Continuous-batching generation on a background thread that owns ``model`` (see the module docstring).

    Args:
        model: a ``DecoderOnlyTransformer`` (put in eval mode; nobody else may run it while the scheduler
            lives -- use :meth:`call` to run something on the model thread, e.g. a glass-box trace).
        tokenizer: decodes tokens into text (stop strings, deltas).
        max_batch: most rows (choices) decoded together; more wait in the queue.
        max_queue: most requests waiting to be admitted; :meth:`submit` raises :class:`QueueFull` beyond.
        keep: tokens kept when a row's window slides (default max_len // 2, as ``generate``).
        prefill_chunk: None (default): a newcomer's prompt is prefilled whole, all newcomers together in one
            padded pass. An integer C >= 1: a prompt longer than C tokens is prefilled alone in chunks of C tokens
            into its own KV cache, one chunk between two decode steps of the running rows, which so keep
            producing tokens while it is read (vLLM's chunked prefill); it joins the batch when its last chunk
            is in. Either way each row gives ``generate``'s tokens (up to the rounding of the chunked
            attention, which the tests check does not change them).

    ``submit(request)`` queues a :class:`GenerationRequest`; its events arrive through ``request.on_event``.
    ``stats()`` returns counters (running rows, waiting requests, decode steps); ``close()`` stops the thread.
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 32, max_queue: int = 64, keep: int | None = None,
                 prefill_chunk: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.prefill_chunk = None if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, 1)
        self._prefilling: collections.deque[_Prefill] = collections.deque()  # long prompts, chunk by chunk
        self.prefill_chunks = 0  # chunks of long prompts run
        self.max_batch, self.max_queue = check_int("max_batch", max_batch, 1), check_int("max_queue", max_queue, 1)
        cfg = model.config
        self.max_len = cfg.max_len
        self.keep = check_keep(keep, cfg.max_len)
        self.device = model_device(model)
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._calls: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._rows: list[_Row] = []  # running rows, in slot order
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0
        self.prefills = 0  # forward passes that admitted newcomers (one per step that admits any)
        self.max_rows_seen = 0
        self._sampler: Sampler | None = None
        self._sampler_rows: list[_Row] = []  # the rows self._sampler was built for, in order
        self._empty_counts: TokenCounts | None = None
        model.eval()
        self._tmp = KVCache(cfg.n_layer, cfg.max_len)
        self._cache = BatchKVCache(cfg.n_layer, 2 * cfg.max_len)
        self._thread = threading.Thread(target=self._run, name="decoderlab-scheduler", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        """Queue ``req``. Raises ``ValueError`` / ``TypeError`` for bad arguments (``generate``'s checks),
        :class:`QueueFull` when ``max_queue`` requests wait already, :class:`SchedulerClosed` after close."""
        self._prepare(req)
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is shut down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (max_queue={self.max_queue})")
            self._waiting.append(req)
            self._cond.notify()

    def _prepare(self, req: GenerationRequest) -> None:
        """Bind ``req``'s settings to the model and tokenizer (``generate``'s own checks) and check its prompt."""
        if not isinstance(req.params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(req.params).__name__}")
        check_int("max_new_tokens", req.params.max_new_tokens, 1)
        req.n = check_int("n", req.n, 1)
        req._bound = req.params.bind(self.model.config.num_tokens, self.tokenizer)
        req.prompt_ids = check_prompt(self.model, req.prompt_ids, self.tokenizer)
        if len(req.prompt_ids) > self.max_len:
            raise ValueError(f"the prompt must have 1 .. {self.max_len} tokens, got {len(req.prompt_ids)}")

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the model thread between two decode steps; returns a ``concurrent.futures.Future``."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is shut down")
            self._calls.append((fn, fut))
            self._cond.notify()
        return fut

    def stats(self) -> dict:
        with self._cond:
            return {"running": len(self._rows), "waiting": len(self._waiting), "steps": self.steps,
                    "max_rows_seen": self.max_rows_seen, "prefilling": len(self._prefilling),
                    "prefill_chunks": self.prefill_chunks}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._calls or self._rows or self._prefilling):
                    self._cond.wait()
                if self._closed:
                    break
                calls = list(self._calls)
                self._calls.clear()
                admit: list[GenerationRequest] = []
                room = self.max_batch - len(self._rows) - sum(p.req.n for p in self._prefilling)
                while self._waiting and (room >= self._waiting[0].n or not self._rows and not admit
                                         and not self._prefilling):
                    req = self._waiting.popleft()
                    room -= req.n
                    admit.append(req)
            for fn, fut in calls:
                if fut.set_running_or_notify_cancel():
                    try:
                        with torch.inference_mode():
                            fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 -- handed to the caller
                        fut.set_exception(e)
            try:
                with torch.inference_mode():
                    self._step(admit)
            except Exception as e:  # noqa: BLE001 -- reported to every running request, then a clean slate
                reqs = {id(r.req): r.req for r in self._rows}
                reqs.update({id(r): r for r in admit})
                reqs.update({id(p.req): p.req for p in self._prefilling})
                self._rows = []
                self._prefilling.clear()
                self._cache = BatchKVCache(self.model.config.n_layer, 2 * self.max_len)
                for req in reqs.values():
                    req.emit(("error", e))
            time.sleep(0)  # let the server's event loop take the GIL between two steps
        # closed: tell whoever is still waiting
        err = SchedulerClosed("the server is shutting down")
        for r in {id(r.req): r.req for r in self._rows}.values():
            r.emit(("error", err))
        for req in [*self._waiting, *(p.req for p in self._prefilling)]:
            req.emit(("error", err))

    def _prefill_alone(self, ids: list[int]) -> torch.Tensor:
        """The window ``ids`` through the model in the single-row cache (as ``generate`` prefills); (V,) logits."""
        self._tmp.reset()
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        # the ids were checked on the host (submit) or sampled: a range check here would wait for the device
        return self.model(tokens, cache=self._tmp, check_ids=False)[0, -1]

    def _prefill_together(self, reqs: list[GenerationRequest]) -> tuple[KVCache, torch.Tensor, list[int]]:
        """The prompts of ``reqs`` through the model in one forward pass: (the cache holding row j's keys/values
        after its pads, (len(reqs), V) last-position logits, each row's pad count). Prompts of different lengths
        are left-padded to the longest with a padding mask and per-row positions (``generate_batch``'s prefill:
        each row the same math as alone, up to the rounding of batched matmuls); equal lengths need no padding."""
        if len(reqs) == 1:
            return self._tmp, self._prefill_alone(list(reqs[0].prompt_ids))[None], [0]
        t = max(len(r.prompt_ids) for r in reqs)
        pads = [t - len(r.prompt_ids) for r in reqs]
        tokens = torch.tensor([[0] * p + list(r.prompt_ids) for p, r in zip(pads, reqs)], dtype=torch.long,
                              device=self.device)
        src = KVCache(self.model.config.n_layer, self.max_len)
        if not any(pads):
            return src, self.model(tokens, cache=src, last_only=True, check_ids=False)[:, -1], pads
        p = torch.tensor(pads, device=self.device).unsqueeze(1)  # (B, 1)
        ar = torch.arange(t, device=self.device).unsqueeze(0)
        logits = self.model(tokens, positions=(ar - p).clamp_min(0), padding_mask=ar < p, cache=src,
                            last_only=True, check_ids=False)[:, -1]  # (the ids were checked in submit)
        return src, logits, pads

    def _admit(self, admit: list[GenerationRequest]) -> None:
        """1. admit: prefill the newcomers together (one forward pass, :meth:`_prefill_together`), copy their
        keys/values into the batch, and sample each one's first token right away (its generator's first draw).
        With ``prefill_chunk``, prompts longer than it wait in ``_prefilling`` instead (:meth:`_prefill_next_chunk`)."""
        live = []
        for req in admit:
            if req._bound is None:  # (a request handed to _step directly rather than through submit)
                self._prepare(req)
            if req.cancelled:
                req.emit(("done", {"prompt_tokens": len(req.prompt_ids), "completion_tokens": 0,
                                   "total_tokens": len(req.prompt_ids)}))
            else:
                live.append(req)
        chunked = {id(r) for r in live if self.prefill_chunk is not None and len(r.prompt_ids) > self.prefill_chunk}
        self._prefilling.extend(_Prefill(r, self.model.config.n_layer, self.max_len) for r in live if id(r) in chunked)
        live = [r for r in live if id(r) not in chunked]
        if live:
            src, all_logits, pads = self._prefill_together(live)
            self.prefills += 1
            self._join(live, src, all_logits, pads)

    def _join(self, live: list[GenerationRequest], src: KVCache, all_logits: torch.Tensor, pads: list[int]) -> None:
        """Newcomers whose prompts are in ``src`` (row j after ``pads[j]`` pads) join the batch: their keys/values
        are copied in and each row's first token is sampled at once (its generator's first draw)."""
        for j, req in enumerate(live):
            req._open_rows = req.n
            for i in range(req.n):
                row = _Row(req, i, self.tokenizer, self.device, self.model.config.num_tokens)
                row.logits = all_logits[j]
                row.slot = self._cache.add_slot()
                self._cache.place(row.slot, src, len(req.prompt_ids), src_row=j, src_start=pads[j])
                self._rows.append(row)
                self._sample([row])
        self.max_rows_seen = max(self.max_rows_seen, len(self._rows))

    def _prefill_next_chunk(self) -> None:
        """One chunk (``prefill_chunk`` tokens) of the oldest long prompt, into its own cache at its own positions
        (as ``generate`` would prefill them, the chunk's queries seeing the cached keys and each other causally);
        after its last chunk the request joins the batch. A cancelled one is dropped here."""
        if not self._prefilling:
            return
        p = self._prefilling[0]
        req, ids = p.req, p.req.prompt_ids
        if req.cancelled:
            self._prefilling.popleft()
            req.emit(("done", {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}))
            return
        chunk = torch.tensor([ids[p.done:p.done + self.prefill_chunk]], dtype=torch.long, device=self.device)
        logits = self.model(chunk, cache=p.cache, last_only=True, check_ids=False)[:, -1]  # (checked in submit)
        p.done += chunk.size(1)
        self.prefill_chunks += 1
        if p.done == len(ids):
            self._prefilling.popleft()
            self._join([req], p.cache, logits, [0])

    def _step(self, admit: list[GenerationRequest]) -> None:
        cache = self._cache
        self._admit(admit)
        self._prefill_next_chunk()
        # 2. cancelled rows go now
        for row in [r for r in self._rows if r.req.cancelled]:
            self._release(row, "cancelled")
        # 3. sample one token for every row whose next logits are known (not the newcomers: done above)
        self._sample([r for r in self._rows if r.logits is not None])
        rows = self._rows
        if not rows:
            return
        # 4. one decode step for every running row; rows whose window slides are re-prefilled alone
        sliding = []
        for r in rows:
            if len(r.ids) - r.start > self.max_len:
                r.start = len(r.ids) - self.keep
                sliding.append(r)
        if cache.length + 1 > cache.capacity:
            cache.compact()
        n = len(rows)
        tokens = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        starts = cache.start_col
        length = cache.length
        if all(c == 0 for c in starts) and length < self.max_len:
            positions: int | torch.Tensor = length  # every row as long as the timeline: no mask (as generate)
            mask = None
        else:
            # a sliding row's position is clamped: its result is replaced by its re-prefill below
            positions = torch.tensor([[min(length - c, self.max_len - 1)] for c in starts], device=self.device)
            mask = None
            if any(c > 0 for c in starts):  # (known on the host: no need to ask the device for mask.any())
                ar = torch.arange(length + 1, device=self.device).unsqueeze(0)
                mask = ar < torch.tensor(starts, device=self.device).unsqueeze(1)  # (n, T_k) True = not this row's
        decode = getattr(self.model, "compiled_decode", None)
        if decode is None:
            decode = self.model.decode
        else:  # the timeline's length (and the rows' position) change at every step: a compiled step takes them
            # as dynamic from its first compile -- dynamo would compile a graph for the first length it sees, then
            # a second, dynamic one (two compiles of the whole model: twice a server's warm-up)
            positions, cache.length = dynamic_int(positions), dynamic_int(cache.length)
            if n > 1:  # and so do the running rows: one graph for every batch of 2 or more, not a graph for 2,
                # then a dynamic one (each a compile of the whole model while every request waits)
                cache.n = dynamic_int(cache.n)
                for t in (tokens, positions, mask):
                    if isinstance(t, torch.Tensor):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            if mask is not None:  # (its columns are the timeline's: as dynamic as its length)
                torch._dynamo.maybe_mark_dynamic(mask, 1)
        logits = decode(tokens, positions, mask, cache)  # the model's own blocks, one token a row
        cache.advance(1)
        self.steps += 1
        for r, lg in zip(rows, logits):
            r.logits = lg
        for r in sliding:
            r.logits = self._prefill_alone(r.ids[r.start:])
            cache.place(r.slot, self._tmp, len(r.ids) - r.start)

    def _sample(self, rows: list[_Row]) -> None:
        """Sample one token for each row -- all together, each with its own settings, generator and penalties'
        state -- and hand it to the row (text, stops; finished rows are released). The rows' logits are used
        up."""
        if not rows:
            return
        if self._sampler_rows != rows:  # the running rows changed: their processors are built again
            self._sampler = Sampler([r.params for r in rows])
            self._sampler_rows = list(rows)
        sampler = self._sampler
        counts = None
        if sampler.uses_counts:
            counts = TokenCounts.cat([r.counts if r.counts is not None else self._no_counts() for r in rows])
        logits = torch.stack([r.logits for r in rows])
        ids = sampler.choose(logits, [] if sampler.greedy else [r.gen for r in rows], counts).tolist()
        sampler.check(ids, logits, counts)  # from the host copy: the step's one wait for the device
        for r, t in zip(rows, ids):
            self._accept(r, t)
            r.logits = None

    def _no_counts(self) -> TokenCounts:
        """Counts for a row without penalties that is sampled with rows that have them (its settings leave
        them unread): one shared empty state."""
        v = self.model.config.num_tokens
        if self._empty_counts is None:
            self._empty_counts = TokenCounts.for_prompts([[]], v, self.device)
        return self._empty_counts

    def _accept(self, r: _Row, token: int) -> None:
        """One sampled token of row ``r``: through its stops (as ``stream`` does), the ids they release through
        its text streamer (as ``stream_text`` does); sends the text and ends the row at a stop or max_new_tokens."""
        req = r.req
        r.produced += 1
        req.completion_tokens += 1
        if req.logprobs is not None:
            r.held_lp.append(self._logprob_item(r.logits, token, req.logprobs))
        r.ids.append(token)
        if r.counts is not None:
            r.counts.add([token])
        out, swallowed = r.stops.push(token)
        text = self._to_text(r, out)
        if swallowed is not None:
            # the text a stop string left inside its first token comes with that token's logprob
            tail = r.stops.tail
            if tail and r.held_lp:
                r.pending_lp.append(r.held_lp.popleft())
            self._send(r, text + r.streamer.end() + tail, final=True)
            self._release(r, "stop", tuple(swallowed))
        elif r.counts is not None and r.counts.complete(0):  # the grammar allows no more text: a stop
            text += self._to_text(r, r.stops.flush())
            self._send(r, text + r.streamer.end(), final=True)
            self._release(r, "stop")
        elif r.produced >= r.params.max_new_tokens:
            text += self._to_text(r, r.stops.flush())
            self._send(r, text + r.streamer.end(), final=True)
            self._release(r, "length")
        elif text:
            self._send(r, text)

    def _to_text(self, r: _Row, ids: list[int]) -> str:
        """The text of ``ids`` (released by the stops) from the row's streamer; their logprob items wait in
        ``pending_lp`` until their text is sent."""
        text = ""
        for t in ids:
            piece = r.streamer.put(t)
            if r.held_lp:
                r.pending_lp.append(r.held_lp.popleft())
            if piece:  # the text of every id given to the streamer so far is out
                text += piece
                r.ready_lp += r.pending_lp
                r.pending_lp = []
        return text

    def _send(self, r: _Row, text: str, final: bool = False) -> None:
        """Emit ``text`` with the logprob items of the tokens whose text is out (at ``final``, of all sent)."""
        items, r.ready_lp = r.ready_lp, []
        if final:
            items += r.pending_lp
            r.pending_lp = []
        if text or items:
            r.req.emit(("delta", r.index, text, items))

    def _logprob_item(self, logits: torch.Tensor, token: int, top: int) -> dict:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = self.tokenizer

        def entry(i: int) -> dict:
            s, raw = logprob_token(tok, i)  # byte tokens as "bytes:\\xNN", OpenAI's and vLLM's
            return {"token": s, "logprob": float(lp[i]), "bytes": raw}

        item = entry(token)
        if top:
            vals, idx = torch.topk(lp, min(top, lp.numel()))
            item["top_logprobs"] = [entry(int(i)) for i in idx.tolist()]
        else:
            item["top_logprobs"] = []
        return item

    def _release(self, r: _Row, reason: str, stop: tuple[int, ...] | None = None) -> None:
        moved = self._cache.remove_slot(r.slot)
        self._rows.remove(r)
        if moved is not None:
            for other in self._rows:
                if other.slot == moved:
                    other.slot = r.slot
                    break
        # keep self._rows in slot order
        self._rows.sort(key=lambda x: x.slot)
        req = r.req
        if reason != "cancelled":
            req.emit(("finish", r.index, reason, stop))
        req._open_rows -= 1
        if req._open_rows == 0:
            req.emit(("done", {"prompt_tokens": len(req.prompt_ids), "completion_tokens": req.completion_tokens,
                               "total_tokens": len(req.prompt_ids) + req.completion_tokens}))
