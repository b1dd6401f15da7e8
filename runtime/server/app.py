"""The FastAPI app of `python -m v41.serve`: `/v1/models` (and `/v1/models/{id}`),
`/v1/completions`, `/v1/chat/completions` (both with SSE streaming), `/tokenize`, `/detokenize`,
`/health`, `/metrics` (Prometheus text) and `/version`, behind an optional bearer key. Every
refusal is an OpenAI-style JSON error. Request bodies are parsed (tokenized, chat rendered) in a
worker thread, so a big prompt does not stall the event loop that streams everyone's tokens."""
from __future__ import annotations

import hmac
import importlib.metadata
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from runtime.server.async_engine import AsyncEngine
from runtime.server.chat import Chat
from runtime.server.completions import Completion
from runtime.server.protocol import APIError, Body, check_model, check_text_sizes, error_response, read_body
from runtime.server.serving import Frontend
from runtime.server.tokens import detokenize, tokenize

log = logging.getLogger("v41.serve")


class BearerAuth:
    """Bearer-key check on every route but /health (pure ASGI: it leaves streaming and
    disconnect detection alone)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = ("Missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "Incorrect API key provided")
                resp = error_response(401, msg, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(aeng: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
               max_logprobs: int = 20, model_path: str | None = None, stall_timeout: float = 30.0,
               max_choices: int = 256, max_body_bytes: int = 16 << 20, max_queued: int = 1024,
               max_prompt_bytes: int | None = None, max_stop_bytes: int = 4096) -> FastAPI:
    """`stall_timeout`: /health answers 503 once the engine loop has not turned for this many
    seconds while requests are queued. `max_queued`: choices waiting to be scheduled, at most.
    The other limits as Frontend takes them."""
    fe = Frontend(aeng, served_model_names, max_logprobs, max_choices=max_choices, max_body_bytes=max_body_bytes,
                  max_queued=max_queued, max_prompt_bytes=max_prompt_bytes, max_stop_bytes=max_stop_bytes)

    async def parsed(request: Request, parse, keys: tuple):
        """The body, the text sizes of its prompt `keys` checked, then `parse(fe, body)` in a
        worker thread."""
        b = await read_body(request, fe.max_body_bytes)
        check_text_sizes(b, keys, fe.max_prompt_bytes, fe.max_stop_bytes)
        return await run_in_threadpool(parse, fe, b)

    @asynccontextmanager
    async def lifespan(app):
        aeng.start()
        yield
        aeng.stop()

    app = FastAPI(title="v41", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, msg)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}: {e}")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not aeng.alive:
            return error_response(503, f"engine not running: {aeng.dead or 'stopped'}")
        stalled = aeng.stalled_for()
        if stalled is not None and stalled > stall_timeout:
            return error_response(503, f"engine has not stepped for {stalled:.0f} s with requests queued "
                                       f"(limit {stall_timeout:g} s)")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(aeng.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version():
        import torch
        eng = aeng.engine
        try:
            v41_version = importlib.metadata.version("v41")
        except importlib.metadata.PackageNotFoundError:
            v41_version = None
        return {"version": v41_version, "torch": torch.__version__, "model": model_path,
                "device": str(eng.runner.device), "torch_threads": torch.get_num_threads(),
                "engine_args": {k: v for k, v in vars(eng.args).items() if k != "extra"},
                "max_model_len": fe.max_model_len}

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": fe.created, "owned_by": "v41", "root": model_path or name,
                "parent": None, "max_model_len": fe.max_model_len, "vocab_size": fe.vocab_size}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(n) for n in fe.names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(Body(model=model_id), fe.names)
        return card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await fe.respond(request, await parsed(request, Completion.parse, ("prompt",)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await fe.respond(request, await parsed(request, Chat.parse, ("messages",)))

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await parsed(request, tokenize, ("prompt", "messages"))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await parsed(request, detokenize, ())

    return BearerAuth(app, api_key) if api_key else app  # type: ignore[return-value]
