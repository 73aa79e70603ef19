"""``GET /v1/models``: the one model this server serves, with its context window."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from .. import deps
from ..protocol import ServerSettings

router = APIRouter()


@router.get("/v1/models")
async def models(
    settings: Annotated[ServerSettings, Depends(deps.server_settings)], llm: Annotated[Any, Depends(deps.engine)]
):
    return {
        "object": "list",
        "data": [
            {
                "id": settings.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "snapkv-rag",
                "max_model_len": llm.context_window,
            }
        ],
    }
