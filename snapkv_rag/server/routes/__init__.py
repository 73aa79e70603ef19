"""The server's routes, one :class:`fastapi.APIRouter` per module: ``POST /v1/chat/completions``
(:mod:`.chat_completions`), ``POST /v1/completions`` (:mod:`.completions`), ``GET /v1/models``
(:mod:`.models`), ``GET /health`` and ``GET /metrics`` (:mod:`.health_and_metrics`). Their checks are
dependencies (:mod:`snapkv_rag.server.deps`); :func:`snapkv_rag.server.app.create_app` includes
:data:`ROUTERS`."""

from . import chat_completions, completions, health_and_metrics, models

ROUTERS = (chat_completions.router, completions.router, models.router, health_and_metrics.router)
