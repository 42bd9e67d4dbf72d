"""``/v1/decoderlab/features``: the served SAE's features for the page (``decoderlab serve --sae DIR``).

``GET`` says which SAE is served (``served`` false without one; then ``POST`` is a 404). ``POST`` takes token ids (the page sends the traced ones)
and answers each position's strongest active features; with a ``feature`` it also answers the last position's
next-token distribution with that feature ablated at every position (its part f_F(x) W_dec[F] removed from the
activation) or steered with (``scale`` x W_dec[F] added at every position) beside the clean one --
``run_with_hooks`` with :func:`~decoderlab.glassbox.features.feature_ablation` /
:func:`~decoderlab.glassbox.features.feature_steering`, the library's own numbers.
"""

from __future__ import annotations

import asyncio
import math
from typing import Literal

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from ..glassbox.cache import run_with_hooks
from ..glassbox.features import feature_ablation, feature_steering, token_features
from .body import JSONRoute
from .errors import ERROR_RESPONSES, APIError, bad
from .prompts import check_context, encode_prompt
from .state import AppState, app_state

router = APIRouter(route_class=JSONRoute, tags=["glass box"])


class FeaturesInfo(BaseModel):
    served: bool = Field(description="whether the server has an SAE (`decoderlab serve --sae DIR`); the other "
                                     "fields are null without one")
    hook: str | None = Field(None, description="the hook point the SAE reads")
    d_sae: int | None = Field(None, description="the number of features (valid indices 0 .. d_sae - 1)")
    d_in: int | None = None
    architecture: str | None = Field(None, description='"topk" or "standard" (ReLU + L1), as SAELens names them')
    k: int | None = Field(None, description="active features per token (TopK), null for ReLU + L1")


class FeaturesRequest(BaseModel):
    model: str | None = None
    token_ids: list[int] = Field(min_length=1, description="the text's token ids")
    top: int = Field(8, ge=1, le=64, description="active features listed per position, strongest first")
    feature: int | None = Field(None, description="a feature to ablate or steer with (0 .. d_sae - 1)")
    mode: Literal["ablate", "steer"] = Field("ablate", description="remove the feature, or add scale x its direction")
    scale: float = Field(4.0, description="steer: the multiple of the feature's unit direction added")
    next_top: int = Field(10, ge=1, le=100, description="tokens listed of each distribution")


class ActiveFeature(BaseModel):
    feature: int
    activation: float


class FeatureChange(BaseModel):
    id: int
    token: str
    before: float = Field(description="probability in the clean pass")
    after: float = Field(description="probability with the intervention")


class FeatureIntervention(BaseModel):
    feature: int
    mode: str
    scale: float | None
    changes: list[FeatureChange] = Field(description="the union of both distributions' top tokens, largest change "
                                                     "first")
    kl: float = Field(description="KL(clean || intervened) of the last position's next token, nats")


class FeaturesResponse(BaseModel):
    hook: str
    d_sae: int
    token_ids: list[int]
    tokens: list[str]
    active: list[list[ActiveFeature]] = Field(description="per position, its strongest active features")
    intervention: FeatureIntervention | None = None


def serve_sae(model, sae) -> tuple:
    """``(sae, hook)`` of a ``SparseAutoencoder`` or an SAE directory, checked against ``model`` (its hook a
    point of the model, its d_in the activation's size there) and put on the model's device.

    Raises ``FileNotFoundError`` for a directory that is not an SAE's; ``ValueError`` for one that does not fit."""
    from ..glassbox.features import hook_activations
    from ..glassbox.sae import SparseAutoencoder, check_sae_hook, load_sae, sae_hook

    where = None if isinstance(sae, SparseAutoencoder) else sae
    sae = sae if where is None else load_sae(where)
    hook = check_sae_hook(model, sae_hook(sae, where))
    d_in = hook_activations(model, [0], hook).shape[-1]
    if d_in != sae.d_in:
        raise ValueError(f"the SAE reads d_in={sae.d_in} at {hook}; this model has {d_in} there")
    return sae.to(model.we.weight.device).eval(), hook


def served_sae(request: Request):
    """The served :class:`~decoderlab.glassbox.sae.SparseAutoencoder` and its hook, or a 404."""
    sae = getattr(request.app.state, "sae", None)
    if sae is None:
        raise APIError(404, "this server serves no sparse autoencoder: start it with `decoderlab serve --sae DIR`",
                       code="not_found")
    return sae


def _intervention(model, tokenizer, sae, hook: str, ids: list[int], body: FeaturesRequest) -> FeatureIntervention:
    if body.mode == "ablate":
        hook_fn = feature_ablation(sae, hook, body.feature)
    else:
        hook_fn = feature_steering(sae, hook, body.feature, body.scale)
    clean = run_with_hooks(model, ids, [])[0, -1].double().cpu()
    changed = run_with_hooks(model, ids, [hook_fn])[0, -1].double().cpu()
    p, q = torch.softmax(clean, -1), torch.softmax(changed, -1)
    kl = float((p * (torch.log_softmax(clean, -1) - torch.log_softmax(changed, -1))).sum())
    n = min(body.next_top, p.numel())
    shown = list(dict.fromkeys(torch.topk(p, n).indices.tolist() + torch.topk(q, n).indices.tolist()))
    changes = sorted((FeatureChange(id=i, token=tokenizer.decode([i]), before=float(p[i]), after=float(q[i]))
                      for i in shown), key=lambda c: -abs(c.after - c.before))
    return FeatureIntervention(feature=body.feature, mode=body.mode,
                               scale=body.scale if body.mode == "steer" else None, changes=changes, kl=kl)


def feature_numbers(model, tokenizer, served, ids: list[int], body: FeaturesRequest) -> FeaturesResponse:
    """The page's numbers (see the module docstring), on the model's thread."""
    sae, hook = served
    active = token_features(model, sae, hook, ids, top=body.top)
    return FeaturesResponse(
        hook=hook, d_sae=sae.d_sae, token_ids=ids, tokens=[tokenizer.decode([i]) for i in ids],
        active=[[ActiveFeature(feature=f, activation=a) for f, a in row] for row in active],
        intervention=None if body.feature is None else _intervention(model, tokenizer, sae, hook, ids, body))


@router.get("/v1/decoderlab/features", response_model=FeaturesInfo, responses=ERROR_RESPONSES)
async def features_info(request: Request) -> FeaturesInfo:
    """Which sparse autoencoder the server serves (``served`` false: none)."""
    if getattr(request.app.state, "sae", None) is None:
        return FeaturesInfo(served=False)
    sae, hook = served_sae(request)
    return FeaturesInfo(served=True, hook=hook, d_sae=sae.d_sae, d_in=sae.d_in, architecture=sae.architecture,
                        k=sae.k)


@router.post("/v1/decoderlab/features", response_model=FeaturesResponse, responses=ERROR_RESPONSES)
async def features_endpoint(body: FeaturesRequest, request: Request,
                            state: AppState = Depends(app_state)) -> FeaturesResponse:
    """Each position's active features, and the next token with one feature ablated or steered with."""
    served = served_sae(request)
    state.check_model(body.model)
    ids = check_context(state, encode_prompt(state, body.token_ids, "token_ids"), "token_ids")
    d_sae = served[0].d_sae
    if body.feature is not None and not 0 <= body.feature < d_sae:
        raise bad("feature", f"feature {body.feature} is out of range; valid features are 0 .. {d_sae - 1} "
                             f"(d_sae={d_sae})")
    if not math.isfinite(body.scale):
        raise bad("scale", f"scale must be a finite number, got {body.scale}")
    fut = state.scheduler().call(lambda: feature_numbers(state.model, state.tokenizer, served, ids, body))
    return await asyncio.wrap_future(fut)
