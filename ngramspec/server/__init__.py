"""``ngramspec serve``: an OpenAI-compatible HTTP server on the batched scheduler.

`create_app` builds the FastAPI app for a backend (`ngramspec.backend.Backend`: the batched
llama.cpp scheduler as `ngramspec.llama.backend.LlamaBackend`);
``python -m ngramspec serve`` (`ngramspec.cli.serve`) loads the model and runs it under uvicorn.
Needs the ``serve`` extra (fastapi, uvicorn, pydantic, prometheus_client).
"""
from ngramspec.server.app import create_app

__all__ = ["create_app"]
