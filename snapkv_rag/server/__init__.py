"""``snapkv-rag serve``: an OpenAI-compatible HTTP server over one engine (the ``server`` extra:
FastAPI, uvicorn, prometheus-client), or over K engines as Ray Serve replicas (``--replicas``, the
``ray`` extra: :mod:`.replicas`). :func:`snapkv_rag.server.app.create_app` builds the app for a
``SnapKVLLM``; the batching and the tool calling are the engine's, this package is the HTTP layer."""
