"""Continuous batching: many generation requests decoded together over one model's KV-cache forward pass.

One background thread owns the model. Requests wait in a bounded queue (:class:`QueueFull` when it is full);
between two decode steps the thread admits waiting requests into the running batch (newcomers' prompts are
prefilled as :func:`decoderlab.generate` prefills them -- prompts of equal length together in one forward
pass without padding, others alone -- their keys/values are copied into the batch cache and their first token
is sampled at once), then samples one token for every running row, releases the rows that finished or were
cancelled, and runs one decode step of one token per row for all the others together.

The batch cache keeps every row's keys/values right-aligned on one timeline of columns: a row that holds W
tokens occupies columns ``length - W .. length - 1``; the columns before them are hidden by a (B, T_k) padding
mask and each row gets its own positions (its tokens count from 0, as when generated alone). When the timeline
is full, the columns no row uses any more are dropped (compaction). A row whose window would pass max_len
slides as :func:`decoderlab.generation.stream` does: its last ``keep`` tokens are re-prefilled alone.

Sampling: every row has its own ``torch.Generator`` (seeded with the request's seed; choice i of a request
with ``n`` > 1 with seed + i) and draws exactly one uniform number per token through
:class:`decoderlab.generation.Sampler`, so a seeded request gives the same tokens alone or batched with others
(up to float rounding of batched matmuls, which the tests check does not change the tokens of small models).

Stop strings are matched on the decoded text (:class:`TextStop`), however the text was tokenized; text that
could still become a stop string is held back until it is resolved. Stop token ids (``<EOS>``, a chat
template's end of turn) end a row without adding text.

Source: the continuous ("iteration-level") batching of Orca (Yu et al., OSDI 2022), as in vLLM's scheduler;
written here over decoderlab's own KV cache.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..attention import KVCache
from .engine import default_keep
from .sampling import Sampler, check_sampling
from .text import TextStreamer


class QueueFull(RuntimeError):
    """The scheduler's queue holds ``max_queue`` waiting requests already; retry later."""


class SchedulerClosed(RuntimeError):
    """The scheduler was shut down."""


# ----------------------------------------------------------------------------------------------------------
# Stop strings on text
# ----------------------------------------------------------------------------------------------------------


class TextStop:
    """Cut a growing text before the first occurrence of any stop string, holding back what could become one.

    ``push(piece) -> (text safe to send, matched)``: ``matched`` is True when a stop string was found; the
    text returned then ends exactly before it and nothing more may be pushed. ``flush()`` returns the text
    held back when generation ends without a match. ``sent`` is the number of characters released so far.
    """

    def __init__(self, stops: Sequence[str] = ()):
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"a stop string must be a non-empty string, got {s!r}")
        self.stops = list(stops)
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        text, sent = self.text, self.sent
        if not self.stops:
            self.sent = len(text)
            return text[sent:], False
        # a stop string can only start at or after `sent`: anything earlier that could start one was held back
        found = [i for i in (text.find(s, max(0, sent)) for s in self.stops) if i >= 0]
        if found:
            end = min(found)
            self.sent = end
            return text[sent:end], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text) - sent), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        end = len(text) - hold
        self.sent = end
        return text[sent:end], False

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """One request: ``n`` continuations of ``prompt_ids``.

    Args:
        prompt_ids: the prompt's token ids (1 .. max_len of them; the caller checks the length).
        max_tokens: the most tokens to sample per choice (>= 1); tokens cut by a stop count.
        temperature, top_k, top_p: as :class:`decoderlab.generation.Sampler` (temperature 0 = greedy).
        stop: stop strings, matched on the decoded text.
        stop_token_ids: ids that end a choice without adding text (e.g. ``<EOS>``).
        suppress_token_ids: ids never sampled (e.g. ``<PAD>``; as ``generate``'s ``suppress_tokens``).
        seed: choice i samples with a ``torch.Generator`` seeded with seed + i; None = fresh entropy.
        n: how many choices.
        logprobs: None, or how many most probable alternatives (0 .. 20) to report with each token's logprob.
        on_event: called from the scheduler thread with each event (a tuple):
            ``("delta", index, text, logprob_items)``, ``("finish", index, reason)`` (reason "stop" or
            "length"; "cancelled" when cancelled), ``("done", usage_dict)`` last, or ``("error", exception)``.
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    suppress_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    on_event: Callable[[tuple], None] | None = None
    cancelled: bool = False
    completion_tokens: int = 0
    _open_rows: int = 0

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

    def __init__(self, req: GenerationRequest, index: int, tokenizer, device):
        self.req, self.index = req, index
        self.ids = list(req.prompt_ids)  # prompt + generated, the window is ids[start:]
        self.start = 0
        self.produced = 0
        self.logits: torch.Tensor | None = None  # (V,) the next token's logits, when known
        self.slot = -1
        self.streamer = TextStreamer(tokenizer)
        self.stopper = TextStop(req.stop)
        self.pending_lp: collections.deque = collections.deque()  # (end offset in text, item)
        self.text_len = 0
        if req.temperature == 0:
            self.gen = None
        else:
            self.gen = torch.Generator(device=device)
            if req.seed is None:
                self.gen.seed()
            else:
                self.gen.manual_seed(req.seed + index)
        self.sampler_key = (float(req.temperature), req.top_k, req.top_p, tuple(req.suppress_token_ids))


# ----------------------------------------------------------------------------------------------------------
# The batch cache
# ----------------------------------------------------------------------------------------------------------


class _SlotLayer:
    """One layer's keys/values for every slot: (S, H, capacity, d_head); rows 0 .. n-1 are the running ones.
    ``update`` is what a model's attention calls (the interface of ``generation.LayerKVCache``)."""

    def __init__(self, owner: "BatchKVCache"):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        n, start = k_new.size(0), o.length
        end = start + k_new.size(2)
        if n != o.n or end > o.capacity:
            raise RuntimeError(f"batch cache misuse: {n} rows for {o.n} slots, end {end} > {o.capacity}")
        self.k[:n, :, start:end] = k_new
        self.v[:n, :, start:end] = v_new
        return self.k[:n, :, :end], self.v[:n, :, :end]


class BatchKVCache:
    """A KV cache whose rows join and leave: see the module docstring. ``length`` is the timeline's used
    columns, ``n`` the running rows (slots 0 .. n-1), ``start_col[i]`` slot i's first column."""

    def __init__(self, n_layer: int, capacity: int):
        self.capacity = capacity
        self.length = 0
        self.n = 0
        self.slots = 0
        self.start_col: list[int] = []
        self.layers = [_SlotLayer(self) for _ in range(n_layer)]

    def advance(self, t: int) -> None:
        self.length += t

    def _grow(self, like: torch.Tensor, want: int) -> None:
        if want <= self.slots:
            return
        new_slots = max(want, 2 * self.slots, 4)
        _, h, _, d = like.shape
        for lay in self.layers:
            k = like.new_zeros(new_slots, h, self.capacity, d)  # zeros: never NaN under a mask
            v = like.new_zeros(new_slots, h, self.capacity, d)
            if lay.k is not None:
                k[: self.slots] = lay.k
                v[: self.slots] = lay.v
            lay.k, lay.v = k, v
        self.slots = new_slots

    def _shift(self, d: int) -> None:
        """Move every running row d columns (right for d > 0, left for d < 0)."""
        n, length = self.n, self.length
        if d == 0 or n == 0:
            return
        for lay in self.layers:
            for t in (lay.k, lay.v):
                if d > 0:
                    t[:n, :, d : d + length] = t[:n, :, :length].clone()
                else:
                    t[:n, :, : length + d] = t[:n, :, -d:length].clone()
        self.length += d
        self.start_col = [c + d for c in self.start_col]

    def compact(self) -> None:
        """Drop the leading columns no running row uses."""
        if self.n == 0:
            self.length = 0
            return
        m = min(self.start_col)
        if m > 0:
            self._shift(-m)

    def add_slot(self) -> int:
        self.n += 1
        self.start_col.append(self.length)
        return self.n - 1

    def place(self, slot: int, src: KVCache, w: int, src_row: int = 0) -> None:
        """Copy the first ``w`` cached tokens of row ``src_row`` of the cache ``src`` into ``slot``, ending at
        the timeline's current end (moving the other rows right when the timeline is shorter than ``w``)."""
        like = src.layers[0].k
        self._grow(like, self.n)
        if self.length < w:
            if self.n > 1:
                self._shift(w - self.length)
            self.length = w
        if self.length > self.capacity:
            raise RuntimeError("batch cache overflow")
        c = self.length - w
        for lay, s in zip(self.layers, src.layers):
            lay.k[slot, :, c : self.length] = s.k[src_row, :, :w]
            lay.v[slot, :, c : self.length] = s.v[src_row, :, :w]
        self.start_col[slot] = c

    def remove_slot(self, slot: int) -> int | None:
        """Release ``slot``; the last running slot moves into it. Returns the index that moved (or None)."""
        last = self.n - 1
        moved = None
        if slot != last:
            for lay in self.layers:
                lay.k[slot, :, : self.length] = lay.k[last, :, : self.length]
                lay.v[slot, :, : self.length] = lay.v[last, :, : self.length]
            self.start_col[slot] = self.start_col[last]
            moved = last
        self.start_col.pop()
        self.n -= 1
        if self.n == 0:
            self.length = 0
        return moved


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

    ``submit(request)`` queues a :class:`GenerationRequest`; its events arrive through ``request.on_event``.
    ``stats()`` returns counters (running rows, waiting requests, decode steps); ``close()`` stops the thread.
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 32, max_queue: int = 64, keep: int | None = None):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        cfg = model.config
        self.max_len = cfg.max_len
        self.keep = default_keep(cfg.max_len) if keep is None else keep
        p = next(model.parameters(), None)
        self.device = p.device if p is not None else torch.device("cpu")
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._calls: collections.deque[tuple[Callable, Future]] = collections.deque()
        self._rows: list[_Row] = []  # running rows, in slot order
        self._cond = threading.Condition()
        self._closed = False
        self.steps = 0
        self.max_rows_seen = 0
        model.eval()
        self._tmp = KVCache(cfg.n_layer, cfg.max_len)
        self._cache = BatchKVCache(cfg.n_layer, 2 * cfg.max_len)
        self._thread = threading.Thread(target=self._run, name="decoderlab-scheduler", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        check_sampling(req.temperature, req.top_k, req.top_p)
        if not req.prompt_ids or len(req.prompt_ids) > self.max_len:
            raise ValueError(f"the prompt must have 1 .. {self.max_len} tokens, got {len(req.prompt_ids)}")
        if req.max_tokens < 1 or req.n < 1:
            raise ValueError(f"max_tokens and n must be >= 1, got {req.max_tokens} and {req.n}")
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is shut down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (max_queue={self.max_queue})")
            self._waiting.append(req)
            self._cond.notify()

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
                    "max_rows_seen": self.max_rows_seen}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._waiting or self._calls or self._rows):
                    self._cond.wait()
                if self._closed:
                    break
                calls = list(self._calls)
                self._calls.clear()
                admit: list[GenerationRequest] = []
                room = self.max_batch - len(self._rows)
                while self._waiting and (room >= self._waiting[0].n or not self._rows and not admit):
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
                self._rows = []
                self._cache = BatchKVCache(self.model.config.n_layer, 2 * self.max_len)
                for req in reqs.values():
                    req.emit(("error", e))
            time.sleep(0)  # let the server's event loop take the GIL between two steps
        # closed: tell whoever is still waiting
        err = SchedulerClosed("the server is shutting down")
        for r in {id(r.req): r.req for r in self._rows}.values():
            r.emit(("error", err))
        for req in self._waiting:
            req.emit(("error", err))

    def _prefill_alone(self, ids: list[int]) -> torch.Tensor:
        """The window ``ids`` through the model in the single-row cache (as ``generate`` prefills); (V,) logits."""
        self._tmp.reset()
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model(tokens, cache=self._tmp)[0, -1]

    def _step(self, admit: list[GenerationRequest]) -> None:
        cache = self._cache
        # 1. admit: prefill the newcomers (prompts of equal length together, in one forward pass without
        #    padding: row for row the same math as alone), copy their keys/values into the batch, and sample
        #    each one's first token right away (its generator's first draw)
        live = []
        for req in admit:
            if req.cancelled:
                req.emit(("done", {"prompt_tokens": len(req.prompt_ids), "completion_tokens": 0,
                                   "total_tokens": len(req.prompt_ids)}))
            else:
                live.append(req)
        by_len: dict[int, list[GenerationRequest]] = {}
        for req in live:
            by_len.setdefault(len(req.prompt_ids), []).append(req)
        for w, group in by_len.items():
            if len(group) == 1:
                src, all_logits = self._tmp, self._prefill_alone(list(group[0].prompt_ids))[None]
            else:
                src = KVCache(self.model.config.n_layer, self.max_len)
                tokens = torch.tensor([r.prompt_ids for r in group], dtype=torch.long, device=self.device)
                all_logits = self.model(tokens, cache=src)[:, -1]
            for j, req in enumerate(group):
                req._open_rows = req.n
                for i in range(req.n):
                    row = _Row(req, i, self.tokenizer, self.device)
                    row.logits = all_logits[j]
                    row.slot = cache.add_slot()
                    cache.place(row.slot, src, w, src_row=j)
                    self._rows.append(row)
                    self._sample([row])
        self.max_rows_seen = max(self.max_rows_seen, len(self._rows))
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
            ar = torch.arange(length + 1, device=self.device).unsqueeze(0)
            mask = ar < torch.tensor(starts, device=self.device).unsqueeze(1)  # (n, T_k) True = not this row's
            if not bool(mask.any()):
                mask = None
        logits = self.model.decode(tokens, positions, mask, cache)  # the model's own blocks, one token a row
        self.steps += 1
        for r, lg in zip(rows, logits):
            r.logits = lg
        for r in sliding:
            r.logits = self._prefill_alone(r.ids[r.start:])
            cache.place(r.slot, self._tmp, len(r.ids) - r.start)

    def _sample(self, rows: list[_Row]) -> None:
        """Sample one token for each row (rows with the same settings together, one draw per row each) and hand
        it to the row (text, stops; finished rows are released). The rows' logits are used up."""
        groups: dict[tuple, list[_Row]] = {}
        for r in rows:
            groups.setdefault(r.sampler_key, []).append(r)
        chosen: list[tuple[_Row, int]] = []
        for key, members in groups.items():
            sampler = Sampler(*key[:3], suppress=key[3])
            logits = torch.stack([r.logits for r in members])
            ids = sampler(logits, [r.gen for r in members] if not sampler.greedy else []).tolist()
            chosen.extend(zip(members, ids))
        for r, t in chosen:
            self._accept(r, t)
            r.logits = None

    def _accept(self, r: _Row, token: int) -> None:
        req = r.req
        r.produced += 1
        req.completion_tokens += 1
        lp_item = None
        if req.logprobs is not None:
            lp_item = self._logprob_item(r.logits, token, req.logprobs)
        if token in req.stop_token_ids:
            tail = r.stopper.push(r.streamer.end())[0] + r.stopper.flush()
            self._send(r, tail, final=True)
            self._release(r, "stop")
            return
        r.ids.append(token)
        piece = r.streamer.put(token)
        text, matched = r.stopper.push(piece) if piece else ("", False)
        if lp_item is not None:
            r.pending_lp.append((len(r.stopper.text), lp_item))
        if matched:
            self._send(r, text, final=True, cut=r.stopper.sent)
            self._release(r, "stop")
            return
        if r.produced >= req.max_tokens:
            tail = r.stopper.push(r.streamer.end())
            text += tail[0]
            if tail[1]:
                self._send(r, text, final=True, cut=r.stopper.sent)
                self._release(r, "stop")
                return
            self._send(r, text + r.stopper.flush(), final=True)
            self._release(r, "length")
            return
        if text:
            self._send(r, text)

    def _send(self, r: _Row, text: str, final: bool = False, cut: int | None = None) -> None:
        items = []
        if r.pending_lp:
            if final:
                limit = cut if cut is not None else math.inf
                items = [it for end, it in r.pending_lp if cut is None or end - len(it["token"]) < limit]
                r.pending_lp.clear()
            else:
                while r.pending_lp and r.pending_lp[0][0] <= r.stopper.sent:
                    items.append(r.pending_lp.popleft()[1])
        if text or items:
            r.req.emit(("delta", r.index, text, items))

    def _logprob_item(self, logits: torch.Tensor, token: int, top: int) -> dict:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = self.tokenizer

        def entry(i: int) -> dict:
            s = tok.decode([i])
            return {"token": s, "logprob": float(lp[i]), "bytes": list(s.encode("utf-8"))}

        item = entry(token)
        if top:
            vals, idx = torch.topk(lp, min(top, lp.numel()))
            item["top_logprobs"] = [entry(int(i)) for i in idx.tolist()]
        else:
            item["top_logprobs"] = []
        return item

    def _release(self, r: _Row, reason: str) -> None:
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
            req.emit(("finish", r.index, reason))
        req._open_rows -= 1
        if req._open_rows == 0:
            req.emit(("done", {"prompt_tokens": len(req.prompt_ids), "completion_tokens": req.completion_tokens,
                               "total_tokens": len(req.prompt_ids) + req.completion_tokens}))
