"""The wire protocol: pydantic v2 models of every request, response, stream chunk and error the server speaks.

OpenAI's field names and types (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and vLLM's
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``); decoderlab's own glass-box shapes (``/v1/decoderlab/*``)
are in :mod:`decoderlab.serve.trace_protocol`. FastAPI validates request bodies through these models and publishes
them in ``/openapi.json``. Numbers are strict: a string where a number belongs (``"temperature": "hot"``), a
float where an integer belongs or a bool where a number belongs is refused, as ``decoderlab.generate`` refuses
them.

A body field is one of three kinds:

* a field of the request model: validated here, turned into sampling settings in
  :func:`decoderlab.serve.generation.settings_of`;
* :data:`IGNORED`: metadata that changes nothing about the output (``user``, ``metadata``, ...), accepted and
  ignored;
* :data:`UNSUPPORTED`: fields that would change the output; accepted only at their neutral value, otherwise
  refused (code ``unsupported_parameter``) naming the field. Supporting one means: delete its line from
  :data:`UNSUPPORTED`, declare it on the request model, and map it in ``settings_of``.

Anything else is refused as an unknown field. Errors raised here are ``PydanticCustomError`` s whose type is
the OpenAI error ``code`` and whose context names the ``param``; :mod:`decoderlab.serve.errors` turns every
validation error into :class:`ErrorResponse` (400).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationInfo, field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

from ..config.limits import ServeLimits
from ..generation.sampling import MAX_SEED


#: metadata fields that change nothing about the output: accepted (any value) and ignored
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                     "parallel_tool_calls"})

#: fields that would change the output and are not supported (by this server, or by the endpoint: ``best_of``
#: and ``echo`` are completions' fields, refused on chat): field -> "is this value neutral?"
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v is None or v == ["text"],
}

#: what a required field holds, for the "is required" message
REQUIRED_HINTS = {"prompt": "a string or a list of token ids", "tokens": "a list of token ids",
                  "messages": 'a list of {"role", "content"} objects'}


def refuse(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error with OpenAI's ``code`` as its type and the ``param`` it names in its context."""
    return PydanticCustomError(code, message, {"param": param})


def _short(value) -> str:
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


def _document_other_fields(schema: dict) -> None:
    """List the ignored and the unsupported fields in the request's JSON schema too (so /docs shows them)."""
    props = schema.setdefault("properties", {})
    for name in sorted(IGNORED):
        props.setdefault(name, {"description": "metadata: accepted and ignored"})
    for name in sorted(UNSUPPORTED):
        props.setdefault(name, {"description": "not supported: refused (400 unsupported_parameter) unless at "
                                               "its neutral value (0, 1, false, empty, \"text\" or \"none\")"})


class _Request(BaseModel):
    """A request body: its own fields, :data:`IGNORED` metadata, :data:`UNSUPPORTED` fields at their neutral
    value; anything else is refused naming the field."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_document_other_fields)

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data):
        if not isinstance(data, dict):
            return data  # pydantic's own "must be an object" error
        for key, value in data.items():
            if key in cls.model_fields or key in IGNORED:
                continue
            if key in UNSUPPORTED:
                if UNSUPPORTED[key](value):
                    continue
                raise refuse(key, f"{key}={_short(value)} is not supported by this server (it would change the "
                                  f"output); remove it", "unsupported_parameter")
            raise refuse(key, f"unknown field {key!r}; supported fields: {', '.join(sorted(cls.model_fields))}",
                         "unsupported_parameter")
        return data


Temperature = Annotated[StrictFloat | None, Field(
    ge=0, le=2, description="0 = greedy (a given 0 is never replaced); default 1")]
TopP = Annotated[StrictFloat | None, Field(gt=0, le=1, description="nucleus sampling: keep the most probable "
                                                                    "tokens up to this probability; 1 keeps all")]
TopK = Annotated[StrictInt | None, Field(ge=-1, description="keep the k most probable tokens; 0, -1 or null: "
                                                            "no top-k filter")]
Seed = Annotated[StrictInt | None, Field(ge=0, le=MAX_SEED, description="choice i samples with seed + i; null: "
                                                                        "fresh entropy")]


class SamplingFields(_Request):
    """The sampling settings every generating endpoint shares (as ``decoderlab.generate``'s)."""

    model: StrictStr | None = Field(None, description="this server's model id (another id is a 404)")
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    seed: Seed = None


class StreamOptions(BaseModel):
    """``stream_options``: only with ``stream: true``."""

    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = Field(None, description="send a last chunk with the usage and no choices")


def _stop_list(value):
    """``stop``: a non-empty string or a list of non-empty strings, as a list (the count is checked against the
    server's limit when the settings are built)."""
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise refuse("stop", f"stop must be a non-empty string or a list of non-empty strings, got {_short(value)}")
    return stops


Penalty = Annotated[StrictFloat | None, Field(ge=-2, le=2, description="OpenAI's penalty over the generated "
                                                                       "tokens, -2 .. 2; 0 = off")]


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema a reply must follow."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = Field(None, description="the schema's name (reported, not used)")
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema (default: any JSON)")
    strict: StrictBool | None = Field(None, description="true: a schema keyword the server cannot enforce is a 400; "
                                                        "false/null: such keywords are ignored")


class ResponseFormat(BaseModel):
    """``response_format``: text (default), any JSON object, or JSON following a schema -- enforced by a
    grammar on the tokens (``decoderlab.generation.Grammar``)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise refuse("response_format", 'response_format of type "json_schema" needs a json_schema object '
                                            '({"name": ..., "schema": {...}})')
        return self


#: structured output as an extra field (vLLM's names): field -> what it holds
GUIDED = {"guided_json": "a JSON schema", "guided_regex": "a regular expression the whole reply matches",
          "guided_grammar": "a Lark or GBNF grammar", "guided_choice": "a list of the allowed replies"}


class GenerationFields(SamplingFields):
    """The fields of both text-generating endpoints."""

    max_tokens: StrictInt | None = Field(None, ge=0, description=f"the most new tokens per choice, at most the "
                                         f"server's --max-tokens (default {ServeLimits.default_max_tokens}); 0 only "
                                         f"with echo")
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: StrictFloat | None = Field(None, gt=0, description="CTRL's penalty over the prompt and the "
                                                   "generated tokens, > 0; 1 = off")
    min_p: StrictFloat | None = Field(None, ge=0, le=1, description="keep tokens at least min_p times as probable "
                                                                    "as the most probable; 0 = off")
    logit_bias: dict[str, StrictFloat] | None = Field(None, description="token id -> bias -100 .. 100 added to its "
                                                      "logit; -100 bans it")
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | None = Field(None, description=GUIDED["guided_json"])
    guided_regex: StrictStr | None = Field(None, description=GUIDED["guided_regex"])
    guided_grammar: StrictStr | None = Field(None, description=GUIDED["guided_grammar"])
    guided_choice: list[StrictStr] | None = Field(None, min_length=1, description=GUIDED["guided_choice"])
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description="up to 4 strings matched on the decoded text; the text ends before the first one found")
    n: StrictInt | None = Field(None, ge=1, description="how many choices (default 1)")
    stream: StrictBool | None = Field(None, description="send server-sent events (chunks), then data: [DONE]")
    stream_options: StreamOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value):
        return _stop_list(value)

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise refuse("stream_options", "stream_options is only allowed when stream is true")
        return value


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def one_prompt(value):
    """A prompt as text or token ids: a string, a list of token ids, or a list holding one of these."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) or _is_ids(value):
        return value
    raise refuse("prompt", "prompt must be a string, a list of token ids, or a list holding one of these (one "
                           "prompt per request)")


def prompt_list(value):
    """One prompt (as :func:`one_prompt`), or a batch kept as its list: several strings, or several token-id
    lists (OpenAI's list of prompts)."""
    if isinstance(value, list) and len(value) > 1 and not _is_ids(value):
        if all(isinstance(p, str) for p in value) or all(_is_ids(p) for p in value):
            return value
        raise refuse("prompt", "prompt must be a string, a list of token ids, or a batch: a list of strings or a "
                               "list of token-id lists")
    return one_prompt(value)


Prompt = Annotated[Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]], Field(
    description="text, or token ids; a list of one of these (one prompt per request)")]

Prompts = Annotated[Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]], Field(
    description="text, or token ids; or a batch: a list of strings or of token-id lists (one choice per prompt "
                "per n, prompt-major: choice index = prompt index * n + i)")]


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``: continue a prompt (any checkpoint)."""

    prompt: Prompts
    logprobs: StrictInt | None = Field(None, ge=0, le=5, description="report each token's logprob and this many "
                                                                     "most probable alternatives")
    echo: StrictBool | None = Field(None, description="the reply starts with the prompt; with logprobs, the "
                                                      "prompt's tokens' logprobs too (the first is null); with "
                                                      "max_tokens 0, only those (scoring, as evaluation harnesses do)")
    best_of: StrictInt | None = Field(None, ge=1, description="sample this many choices and return the n with the "
                                                              "highest logprob per token (>= n; not with stream)")
    add_special_tokens: StrictBool | None = Field(None, description="vLLM's: a text prompt gets the tokens the "
                                                  "tokenizer puts around a text (Llama's start token <s>; default "
                                                  "true); token-id prompts are taken as given")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        return prompt_list(value)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a list of one for a single prompt."""
        one = isinstance(self.prompt, str) or all(isinstance(i, int) for i in self.prompt)
        return [self.prompt] if one else list(self.prompt)


class TextPart(BaseModel):
    """One text part of a message's content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class FunctionCall(BaseModel):
    """The function a tool call calls: its name and its arguments as JSON text."""

    name: StrictStr
    arguments: StrictStr


class ToolCall(BaseModel):
    """One tool call of an assistant message (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message: a role and its text (a string, or a list of text parts, which are joined). ``developer``
    is OpenAI's newer name for ``system`` and is rendered as one. An assistant message may carry
    ``tool_calls`` (its content then may be null); a ``tool`` message is the result of the call
    ``tool_call_id`` names."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _content_given(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise refuse("content", "content is required (null only for an assistant message with tool_calls)",
                         "missing_required_parameter")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value):
        if value is None:
            return value  # (allowed only with tool_calls: checked after)
        if isinstance(value, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in value):
                raise PydanticCustomError("invalid_value", "only text content parts are supported")
            return "".join(c["text"] for c in value)
        if not isinstance(value, str):
            raise PydanticCustomError("invalid_value", "the content must be a string or a list of text parts, "
                                                       "got {got}", {"got": _short(value)})
        return value


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``: the next assistant turn (checkpoints with a chat template)."""

    tools: list[dict[str, Any]] | None = Field(None, max_length=64, description='functions the model may call: '
                                               '[{"type": "function", "function": {"name", "description", '
                                               '"parameters": JSON schema}}] (a chat template that writes tool calls)')
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"auto" (default with tools): the model decides; "none"; "required": one call; '
                          '{"type": "function", "function": {"name"}}: that call. The arguments follow the '
                          'function\'s parameters schema (a grammar)')

    messages: list[ChatMessage] = Field(min_length=1, description="rendered with the checkpoint's chat template")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, description="the most new tokens per choice "
                                                                            "(wins over max_tokens)")
    logprobs: StrictBool | None = Field(None, description="report each token's logprob")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="with logprobs: this many most "
                                                                          "probable alternatives")

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise refuse("top_logprobs", "top_logprobs needs logprobs set to true")
        return value


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's shape): the ids of a ``prompt`` -- encoded as ``/v1/completions`` encodes it --
    or of ``messages`` rendered with the chat template (with the assistant opener, as chat completions does)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = Field(None, min_length=1, description="the text to encode")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a conversation to render")
    tools: list[dict[str, Any]] | None = Field(None, max_length=64, description="with messages: the functions "
                                               "offered, rendered as chat completions renders them (so a client "
                                               "can count the tool block before sending)")
    add_special_tokens: StrictBool | None = Field(None, description="prompt: put the tokens the tokenizer puts "
                                                  "around a text (Llama's start token <s>) around it, as "
                                                  "/v1/completions does (default true); messages: the chat "
                                                  "template writes its own (ignored)")
    add_generation_prompt: StrictBool | None = Field(None, description="messages: open the assistant turn "
                                                                       "(default true)")
    return_token_strs: StrictBool | None = Field(None, description="accepted: the pieces are always returned")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise refuse("prompt", "give prompt (a non-empty string) or messages, not both",
                         "missing_required_parameter" if self.prompt is None else "invalid_value")
        if self.tools and self.messages is None:
            raise refuse("tools", "tools are rendered with messages (a chat template's tool block); give messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] = Field(description="each token's text (a control token's name; bytes of a partial "
                                              "character as \\xNN)")


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids -> text, as generation writes it (control tokens are not text)."""

    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(description="token ids")


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client needs to tokenize for this model through /tokenize."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    eos_token: str | None
    bos_token: str | None = None
    pad_token: str | None
    chat_template: str | None = Field(None, description="decoderlab's templates are not Jinja: null")


# ----------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error, server_error")
    param: str | None = Field(description="the request field at fault, e.g. messages[1].role")
    code: str | None = Field(description="e.g. invalid_value, unsupported_parameter, context_length_exceeded")


class ErrorResponse(BaseModel):
    """Every error (HTTP 4xx/5xx, or an event ending a stream)."""

    error: ErrorDetail


# ----------------------------------------------------------------------------------------------------------
# Responses and chunks
# ----------------------------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token: its text, logprob and most probable alternatives (null for the first token of an echoed
    prompt, which nothing predicts)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Response):
    """One server-sent event of a streamed completion (``usage`` only with ``stream_options.include_usage``)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_given(self, handler):
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """What a chunk adds to a tool call: first its id, type and name (arguments ""), then argument pieces."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    """What a chunk adds to a choice: the role first, then content or tool calls; the fields not given are left
    out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _given_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_Response):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The served model (OpenAI's id/object/created/owned_by, plus its shape)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "decoderlab"
    max_len: int = Field(description="the context length, in tokens")
    vocab_size: int
    parameters: int
    n_layer: int
    n_head: int
    d_model: int
    chat_template: str | bool | None = Field(description="the chat template's name; null for a base model")
    task: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health`` (never needs the API key): the model id and the scheduler's counters."""

    status: Literal["ok"] = "ok"
    model: str
    running: int | None = Field(None, description="rows (choices) being decoded")
    waiting: int | None = Field(None, description="requests waiting to join the batch")
    steps: int | None = Field(None, description="decode steps so far")
    max_rows_seen: int | None = Field(None, description="the largest batch so far")
