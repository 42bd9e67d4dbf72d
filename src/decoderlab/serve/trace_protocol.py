"""decoderlab's own wire shapes: the pydantic v2 models of the glass box's endpoints, ``POST
/v1/decoderlab/trace`` and ``GET /v1/decoderlab/head_scores`` (OpenAI's and vLLM's shapes live in
:mod:`decoderlab.serve.protocol`).

A trace request is validated as strictly as a completion (its sampling fields are
:class:`~decoderlab.serve.protocol.SamplingFields`); a response holds every number the page draws: attention
percents (heads, T, T), the logit lens per layer, a logit's exact decomposition, head detector scores and an
ablation's change of the next-token distribution.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from ..glassbox.watching import WATCH_FILE
from .protocol import ChatMessage, Prompt, SamplingFields, one_prompt, refuse


# ----------------------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------------------


class HeadRef(BaseModel):
    """One attention head: ``{"layer": L, "head": h}``."""

    model_config = ConfigDict(extra="forbid")
    layer: StrictInt = Field(ge=0)
    head: StrictInt = Field(ge=0)


class TraceRequest(SamplingFields):
    """``POST /v1/decoderlab/trace``: the glass-box numbers of one of ``prompt`` (+ ``continuation``),
    ``messages`` (+ ``continuation``: the reply so far) or ``token_ids``. The prompt must fit the context, as
    for /v1/completions."""

    prompt: Prompt | None = None
    continuation: StrictStr | None = Field(None, description="generated text after the prompt, encoded on its "
                                                             "own; its window slides past max_len as generation's")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="a conversation; a last "
                                               "assistant message is a reply whose window slides as generation's")
    token_ids: list[StrictInt] | None = None
    top: StrictInt = Field(10, ge=1, le=50, description="how many most probable next tokens to list")
    layers: list[StrictInt] | None = Field(None, description="layer indices to trace (default all)")
    position: StrictInt | None = Field(None, description="the position the logit lens and the decomposition read "
                                                         "(negative counts from the end; default the last)")
    token: StrictInt | None = Field(None, ge=0, description="the token whose logit is decomposed (default: the "
                                                            "most probable one at position)")
    scores: Literal["text", "probe"] | None = Field(None, description="head detector scores of every head: on "
                                                    "the traced tokens, or on the probe (random tokens repeated "
                                                    "twice, as decoderlab train --watch-heads records); default "
                                                    "none")
    ablate: list[HeadRef] | None = Field(None, description="heads to zero-ablate (their blocks.L.attn.hook_z "
                                                           "slice) in a second pass: the response's ablation")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        return None if value is None else one_prompt(value)

    @model_validator(mode="after")
    def _something_to_trace(self):
        if self.prompt is None and self.messages is None and self.token_ids is None:
            raise refuse("prompt", "give prompt (text), messages, or token_ids", "missing_required_parameter")
        if self.continuation is not None and self.token_ids is not None:
            raise refuse("continuation", "a continuation follows a prompt or messages, not token_ids (append the "
                                         "ids instead)")
        if self.continuation is not None and self.messages is not None and self.messages[-1].role == "assistant":
            raise refuse("continuation", "with messages, a continuation is the reply so far after the generation "
                                         "prompt: the last message must not be an assistant message (send the "
                                         "reply as the continuation, or as that message without a continuation)")
        return self


# ----------------------------------------------------------------------------------------------------------
# Responses
# ----------------------------------------------------------------------------------------------------------


class TokenProb(BaseModel):
    id: int
    token: str
    prob: float


class TraceToken(BaseModel):
    id: int
    token: str


class TraceNext(TraceToken):
    ends_text: bool = Field(description="the token is one of the tokenizer's end-of-text ids (<EOS>, a chat "
                                        "template's end of turn): generation stops there, and so does stepping")


class TraceLensEntry(BaseModel):
    label: str = Field(description='"L_pre": the residual stream entering layer L; "final_post": the last '
                                   "block's output (the model's own next-token distribution)")
    top: list[TokenProb] = Field(description="the most probable next tokens read from that residual through the "
                                             "final norm and the output layer")


class TracePart(BaseModel):
    label: str = Field(description='"embed", "pos_embed", "L{L}H{h}" (a head), "L{L} attn bias", "L{L} mlp", '
                                   '"final norm bias", "unembed bias"')
    value: float = Field(description="its direct contribution to the logit")


class TraceDecomposition(BaseModel):
    """``decoderlab.glassbox.decompose``: a logit split into what wrote the residual stream, the final norm's
    scale frozen from this pass (TransformerLens's convention), so the parts add up to the logit."""

    position: int
    token: TraceToken
    logit: float = Field(description="the model's logit of token at position")
    total: float = Field(description="the sum of the parts: the logit, up to float rounding")
    parts: list[TracePart]


class TraceHeadScores(BaseModel):
    on: Literal["text", "probe"] = Field(description="the traced tokens, or the probe (random tokens repeated "
                                                     "twice)")
    scores: dict[str, list[list[float]]] = Field(description="detector -> (n_layer, n_head) scores "
                                                             "(decoderlab.glassbox.all_head_scores)")


class TraceChange(BaseModel):
    id: int
    token: str
    before: float = Field(description="probability in the clean pass")
    after: float = Field(description="probability with the heads ablated")


class TraceAblation(BaseModel):
    """The last position's next-token distribution (softmax of the logits) with ``heads`` zero-ablated."""

    heads: list[HeadRef]
    top: list[TokenProb]
    changes: list[TraceChange] = Field(description="the tokens of both top lists, largest change first")
    kl: float = Field(description="KL(clean || ablated) of the whole distribution, in nats")


class TraceLayer(BaseModel):
    layer: int
    heads: list[int]
    percents: list[list[list[float]]] = Field(description="(heads, T, T) attention percents, queries down, keys "
                                                          "across; rows sum to 1")


class TraceSampling(BaseModel):
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None


class TraceResponse(BaseModel):
    """The glass box of ``decoderlab.trace`` for the traced tokens (T of them)."""

    token_ids: list[int]
    tokens: list[str]
    n_layer: int
    n_head: int
    mask: list[list[bool]] | None = Field(description="(T, T) True where a key is hidden from a query")
    layers: list[TraceLayer]
    top_before: list[TokenProb] = Field(description="the next token's most probable ids (softmax of the logits)")
    top_after: list[TokenProb] = Field(description="... after the sampling filter (temperature, top-k, top-p)")
    next: TraceNext = Field(description="the token the filter's distribution gives next")
    ended: bool = Field(description="the traced tokens end a turn: messages ending with an assistant reply, "
                                    "rendered with the template's end of turn (nothing follows it)")
    sampling: TraceSampling
    position: int = Field(description="the position the lens and the decomposition read (0 .. T - 1)")
    lens: list[TraceLensEntry] = Field(description="the logit lens at position, one entry per layer and the end")
    decomposition: TraceDecomposition
    head_scores: TraceHeadScores | None = Field(None, description="with scores (null for fewer than 2 tokens on "
                                                                  "the text)")
    ablation: TraceAblation | None = Field(None, description="with ablate")


class HeadScoreRecord(BaseModel):
    step: int
    loss: float | None = Field(description="the mean training loss since the previous record, nats per token "
                                           "(null at step 0)")
    scores: dict[str, list[list[float]]] = Field(description="detector -> (n_layer, n_head) scores on the probe")


class HeadScoresResponse(BaseModel):
    records: list[HeadScoreRecord] = Field(description="in step order; empty when the served directory has no "
                                                       f"{WATCH_FILE} (a run trained without --watch-heads)")
    threshold: float = Field(description="the score at which a head counts as formed")
    formed: dict[str, dict[str, int | None]] = Field(
        description='detector -> head ("L1H0") -> the first recorded step its score reached the threshold')
