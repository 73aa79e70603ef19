"""``snapkv-rag serve``: an OpenAI-compatible HTTP server over one engine (the ``server`` extra:
FastAPI, uvicorn, prometheus-client). :func:`snapkv_rag.server.app.create_app` builds the app for a
``SnapKVLLM``; the batching is the engine's, this package is the HTTP layer only."""
