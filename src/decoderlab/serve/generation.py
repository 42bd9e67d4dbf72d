"""The server's one door to the generation engine: request fields -> sampling settings -> the scheduler's
request, and the trace page's next-token sampler. Nothing else in ``decoderlab.serve`` calls the engine.

:func:`settings_of` is the one place where a request's fields become sampling settings (a field added to
``protocol.py`` is mapped here); :func:`submit` and :func:`next_token` are the only calls into
:mod:`decoderlab.generation`; the other modules read a :class:`Settings` only for ``n`` and ``logprobs`` (and
:func:`described` for the trace). Every row follows ``decoderlab.generate``'s rules with the tokenizer: ``<PAD>``
never sampled, the end-of-text tokens (``<EOS>``, a chat template's end of turn) end the text, ``top_k`` 0 = no
filter, stop strings matched on the decoded text.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import torch

from ..config.limits import ServeLimits
from ..generation import Grammar, Sampler, SamplingParams, SamplingTypeError, SamplingValueError
from ..generation.scheduler import GenerationRequest, QueueFull, SchedulerClosed
from ..generation.scoring import logprob_token, score_tokens
from ..generation.stops import parse_stops
from .errors import APIError, bad
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .state import AppState


@dataclass(frozen=True)
class Settings:
    """What a request asks of the engine, checked: ``params`` (the :class:`decoderlab.generation.SamplingParams`
    of every choice: new tokens, temperature, top-k, top-p, stop strings, seed -- choice i uses seed + i), ``n``
    choices and ``logprobs`` (None, or how many alternatives). The other attributes read ``params`` under the
    API's names."""

    params: SamplingParams
    n: int = 1
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    grammar_param: str | None = None

    @property
    def choices(self) -> int:
        """The choices generated: ``best_of`` when given (the best ``n`` are returned), else ``n``."""
        return self.best_of or self.n

    @property
    def max_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def top_k(self) -> int | None:
        return self.params.top_k

    @property
    def top_p(self) -> float | None:
        return self.params.top_p

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.params.stop or ())


def described(settings: Settings) -> dict:
    """The sampling settings as the trace reports them (``temperature``, ``top_k``, ``top_p``, ``seed``)."""
    return {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p,
            "seed": settings.seed}


def _max_tokens(body, limits: ServeLimits) -> int:
    given = getattr(body, "max_completion_tokens", None)
    name = "max_completion_tokens" if given is not None else "max_tokens"
    value = given if given is not None else getattr(body, "max_tokens", None)
    if value is None:
        return min(limits.default_max_tokens, limits.max_tokens)
    if value > limits.max_tokens:
        raise bad(name, f"{name}={value} is above this server's limit of {limits.max_tokens} tokens (--max-tokens)",
                  "max_tokens_limit")
    return value


def _logprobs(body) -> int | None:
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs if isinstance(body, CompletionRequest) else None


def _grammar(body) -> tuple[Grammar | None, str | None]:
    """(the grammar a request's structured-output fields ask for, the field that asked); at most one field.

    Raises: a 400 naming the field, for two of them or a schema / grammar the library cannot compile."""
    asked = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        asked.append("response_format")
    asked += [f for f in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
              if getattr(body, f, None) is not None]
    if not asked:
        return None, None
    if len(asked) > 1:
        raise bad(asked[1], f"{' and '.join(asked)} each constrain the reply; give one of them")
    field = asked[0]
    try:
        if field == "response_format":
            spec = fmt.json_schema
            if fmt.type == "json_object" or spec.schema_ is None:
                return Grammar.json_object(), field
            return Grammar.json_schema(spec.schema_, strict=bool(spec.strict)), field
        make = {"guided_json": Grammar.json_schema, "guided_regex": Grammar.regex,
                "guided_grammar": Grammar.lark, "guided_choice": Grammar.choice}[field]
        return make(getattr(body, field)), field
    except (TypeError, ValueError) as e:
        raise bad(field, f"{field}: {e}", "invalid_grammar") from None


def _echo_and_best_of(body, n: int, limits: ServeLimits) -> tuple[bool, int | None]:
    echo, best_of = bool(getattr(body, "echo", None)), getattr(body, "best_of", None)
    if echo and n > 1:
        raise bad("echo", f"echo needs n=1 (one choice that repeats the prompt), got n={n}")
    if best_of is not None:
        if best_of < n:
            raise bad("best_of", f"best_of={best_of} must be >= n={n}")
        if best_of > limits.max_n:
            raise bad("best_of", f"best_of={best_of} is above this server's limit of {limits.max_n} choices",
                      "n_limit")
        if best_of > n and getattr(body, "stream", None):
            raise bad("best_of", "best_of > n cannot stream: the best choices are known only at the end")
    max_tokens = getattr(body, "max_tokens", None)
    if max_tokens == 0 and not echo:
        raise bad("max_tokens", "max_tokens=0 is only allowed with echo (scoring the prompt); give max_tokens >= 1")
    return echo, best_of if best_of is not None and best_of > n else None


#: the library's field -> the request's field, where their names differ (for the 400s)
_PARAM_NAMES = {"max_new_tokens": "max_tokens"}


def settings_of(body: SamplingFields, limits: ServeLimits) -> Settings:
    """The settings of a request (completions, chat or trace): one ``SamplingParams``, checked by the engine's
    own checks, and this server's limits; each violation is a 400 naming the field."""
    stop = tuple(getattr(body, "stop", None) or ())
    if len(stop) > limits.max_stop:
        raise bad("stop", f"stop has {len(stop)} strings; at most {limits.max_stop} are allowed")
    n = getattr(body, "n", None) or 1
    if n > limits.max_n:
        raise bad("n", f"n={n} is above this server's limit of {limits.max_n} choices", "n_limit")
    echo, best_of = _echo_and_best_of(body, n, limits)
    grammar, grammar_param = _grammar(body)
    extra = {f: getattr(body, f) for f in ("min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                                           "logit_bias") if getattr(body, f, None) is not None}
    try:  # generate's own checks (the protocol has checked the API's ranges already)
        params = SamplingParams(max_new_tokens=_max_tokens(body, limits),
                                temperature=1.0 if body.temperature is None else body.temperature,
                                top_k=None if body.top_k == -1 else body.top_k, top_p=body.top_p, stop=stop or None,
                                seed=body.seed, grammar=grammar, **extra)
    except (SamplingTypeError, SamplingValueError) as e:
        raise bad(_PARAM_NAMES.get(e.field, e.field), str(e)) from None
    return Settings(params=params, n=n, logprobs=_logprobs(body), best_of=best_of, echo=echo,
                    grammar_param=grammar_param)


def _producible(state: AppState, stops: tuple[str, ...]) -> list[str]:
    """The stop strings this model could write. ``generate`` refuses a string its tokenizer cannot encode;
    clients send their usual stops to any model, and a stop that can never appear changes no text, so the
    server leaves it out."""
    out = []
    for s in stops:
        try:
            parse_stops(s, state.tokenizer, state.model.config.num_tokens)
        except ValueError:
            continue
        out.append(s)
    return out


def submit(state: AppState, settings: Settings, ids: list[int], stop_ids: list[int],
           on_event: Callable[[tuple], None]) -> GenerationRequest:
    """Queue ``settings.choices`` continuations of ``ids`` on the scheduler; ``stop_ids`` end a choice as the
    end-of-text tokens do (a chat template's end of turn, whatever the tokenizer names). ``on_event`` gets the scheduler's events (on its thread).

    Raises: :class:`APIError` 400 (a setting the model or tokenizer refuses: a ``logit_bias`` id out of the
    vocabulary, a grammar its vocabulary cannot compile), 429 (queue full, with ``Retry-After``) or 503
    (shutting down)."""
    params = settings.params.replace(stop=_producible(state, settings.stop) + list(stop_ids) or None)
    # best_of ranks the choices by their tokens' logprobs, so they are reported (and dropped from the answer)
    logprobs = settings.logprobs if settings.best_of is None or settings.logprobs is not None else 0
    req = GenerationRequest(prompt_ids=ids, params=params, n=settings.choices, logprobs=logprobs, on_event=on_event)
    try:
        state.scheduler().submit(req)
    except (SamplingValueError, SamplingTypeError) as e:  # bound to the model: token ids, the grammar's vocabulary
        param = settings.grammar_param if e.field == "grammar" else _PARAM_NAMES.get(e.field, e.field)
        raise bad(param, str(e), "invalid_grammar" if e.field == "grammar" else "invalid_value") from None
    except QueueFull as e:
        raise APIError(429, f"the server is busy: {e}", type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": "1"}) from None
    except SchedulerClosed as e:
        raise APIError(503, str(e), type="server_error", code="shutting_down") from None
    return req


async def prompt_items(state: AppState, ids: list[int], top: int) -> list[dict]:
    """The logprob items of the prompt's tokens (the scheduler's shape: token, logprob, bytes, top_logprobs),
    scored in one forward pass on the model's thread; the first token's logprob and alternatives are None.

    Raises: :class:`APIError` 503 when the scheduler is shut down."""
    tok = state.tokenizer
    try:
        scores = await asyncio.wrap_future(state.scheduler().call(lambda: score_tokens(state.model, ids, top=top)))
    except SchedulerClosed as e:
        raise APIError(503, str(e), type="server_error", code="shutting_down") from None

    def entry(i: int, lp) -> dict:
        s, raw = logprob_token(tok, i)
        return {"token": s, "logprob": None if lp is None else float(lp), "bytes": raw}

    items = [dict(entry(ids[0], None), top_logprobs=None)]
    for t in range(len(ids) - 1):
        item = entry(ids[t + 1], scores.logprobs[t])
        item["top_logprobs"] = [entry(int(i), v) for i, v in zip(scores.top_ids[t].tolist(),
                                                                  scores.top_logprobs[t].tolist())]
        items.append(item)
    return items


def event_queue() -> tuple[asyncio.Queue, Callable[[tuple], None]]:
    """An asyncio queue on the running loop and the callback that feeds it from the scheduler's thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    return queue, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev)


def next_token(settings: Settings, tokenizer, logits: torch.Tensor, position: int) -> tuple[torch.Tensor, int]:
    """The trace page's sampler on the last position's logits (V,): (the distribution after the sampling
    filter, (V,) probabilities; the token it gives next). ``<PAD>`` is never chosen, as in generation; greedy
    for temperature 0, else seeded with ``seed + position`` (so stepping is reproducible)."""
    sampler = Sampler(settings.params.bind(logits.numel(), tokenizer).params)  # bound as generation binds it
    if sampler.greedy:
        nxt = int(sampler(logits[None], [])[0])
        after = torch.zeros_like(logits)
        after[nxt] = 1.0
        return after, nxt
    g = torch.Generator().manual_seed((settings.seed if settings.seed is not None else 0) + position)
    return torch.softmax(sampler.filter(logits[None])[0], dim=-1), int(sampler(logits[None], [g])[0])
