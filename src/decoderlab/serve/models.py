"""``GET /v1/models``, ``GET /v1/models/{id}`` (the served model's card) and ``GET /health``."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from .errors import ERROR_RESPONSES, APIError
from .protocol import Health, ModelCard, ModelList
from .state import AppState, app_state

router = APIRouter(tags=["models"])


def model_card(state: AppState) -> ModelCard:
    cfg, template = state.model.config, state.template
    return ModelCard(id=state.model_id, created=state.created, max_len=cfg.max_len, vocab_size=cfg.num_tokens,
                     parameters=state.model.num_parameters(), n_layer=cfg.n_layer, n_head=cfg.n_head,
                     d_model=cfg.d_model, task=state.meta.get("task"),
                     chat_template=None if template is None else getattr(template, "name", True))


@router.get("/health", response_model=Health)
async def health(state: AppState = Depends(app_state)) -> Health:
    """Never needs the API key; answered while the model is busy."""
    return Health(model=state.model_id, **state.stats())


@router.get("/v1/models", response_model=ModelList, responses={401: ERROR_RESPONSES[401]})
async def list_models(state: AppState = Depends(app_state)) -> ModelList:
    """The one model this server serves."""
    return ModelList(data=[model_card(state)])


@router.get("/v1/models/{name:path}", response_model=ModelCard,
            responses={401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]})
async def get_model(name: str, state: AppState = Depends(app_state)) -> ModelCard:
    """The model named ``name`` (404 for another id)."""
    if name != state.model_id:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    return model_card(state)
