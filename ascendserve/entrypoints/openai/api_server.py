"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM, served by uvicorn."""

import asyncio
import contextlib
import hmac
import inspect
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ascendserve.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from ascendserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                     DetokenizeResponse, TokenizeRequest)
from ascendserve.entrypoints.openai.serving_chat import OpenAIServingChat
from ascendserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from ascendserve.entrypoints.openai.serving_engine import ServerOptions
from ascendserve.entrypoints.openai.serving_models import ServingModels
from ascendserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from ascendserve.logger import init_logger
from ascendserve.version import __version__

logger = init_logger(__name__)

# vLLM's VLLM_LOG_STATS_INTERVAL default, in seconds.
DEFAULT_LOG_STATS_INTERVAL_S = 10.0


@dataclass
class FrontendOptions:
    """vLLM's HTTP-layer flags: --disable-fastapi-docs, --enable-request-id-headers, --middleware,
    --enable-server-load-tracking, --root-path."""

    docs: bool = True  # /docs, /redoc, /openapi.json
    request_id_headers: bool = False  # X-Request-Id on every response
    middleware: list = field(default_factory=list)  # ASGI middleware classes or async functions(request, call_next)
    load_tracking: bool = False  # count the generation requests in flight (GET /load)
    # The prefix a path-routing proxy puts in front of our paths (FastAPI's root_path, as vLLM sets it): the routes
    # answer with it and without it (a proxy that strips it), and /docs points at <root_path>/openapi.json
    root_path: str = ""


# The routes --enable-server-load-tracking counts while they run (a stream until its last byte).
LOAD_TRACKED_PATHS = ("/v1/chat/completions", "/v1/completions")


def build_app(engine, models: ServingModels, options: ServerOptions, *, metrics=None, api_keys: list[str] = (),
              cors: dict | None = None, reasoning_parser_cls=None, tool_parser_cls=None,
              log_stats_interval: float | None = None, frontend: FrontendOptions | None = None) -> FastAPI:
    """The FastAPI app of one server; `engine` is an AsyncLLM (or a test double with its surface)."""
    frontend = frontend or FrontendOptions()
    docs = {} if frontend.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ascendserve OpenAI-compatible server", version=__version__,
                  lifespan=_lifespan(metrics, log_stats_interval), root_path=frontend.root_path, **docs)
    app.state.server_load = 0
    chat = OpenAIServingChat(engine, models, options, reasoning_parser_cls, tool_parser_cls)
    completion = OpenAIServingCompletion(engine, models, options)
    tokenization = OpenAIServingTokenization(engine, models, options)
    install_error_handlers(app)
    if api_keys:
        _install_api_key_check(app, list(api_keys))
    _install_frontend_middleware(app, frontend)
    cors = cors or {}
    app.add_middleware(CORSMiddleware, allow_origins=cors.get("allowed_origins", ["*"]),
                       allow_credentials=cors.get("allow_credentials", False),
                       allow_methods=cors.get("allowed_methods", ["*"]),
                       allow_headers=cors.get("allowed_headers", ["*"]))

    @app.get("/health")
    async def health():
        if engine.errored:
            return error_response("The engine loop has failed.", 503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():  # vLLM's SageMaker-style health check: /health's answer
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def server_load():  # vLLM's: 0 unless --enable-server-load-tracking
        return {"server_load": app.state.server_load}

    @app.get("/v1/models")
    async def list_models():
        return models.list_models()

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes (Qwen/Qwen3.5-27B)
    async def retrieve_model(model: str):
        return models.retrieve_model(model)

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await completion.create_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await tokenization.create_tokenize(request, chat)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.create_detokenize(request)

    return app


def _lifespan(metrics, interval: float | None):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        task = None
        if metrics is not None and interval:
            task = asyncio.create_task(_log_stats_forever(metrics, interval))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
    return lifespan


async def _log_stats_forever(metrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        metrics.log()


def _install_frontend_middleware(app: FastAPI, frontend: FrontendOptions) -> None:
    """--middleware (each user middleware in the order given), X-Request-Id headers and load tracking."""
    for middleware in frontend.middleware:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
    if frontend.request_id_headers:
        @app.middleware("http")
        async def add_request_id(request: Request, call_next):
            request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
            response = await call_next(request)
            response.headers["X-Request-Id"] = request_id
            return response
    if frontend.load_tracking:
        app.add_middleware(_LoadTracker, state=app.state)


class _LoadTracker:
    """ASGI middleware: app.state.server_load counts the LOAD_TRACKED_PATHS requests until their response (a stream
    to its end) is sent or the client is gone."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _route_path(scope) not in LOAD_TRACKED_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


def _route_path(scope) -> str:
    """The request's path without --root-path, as the router matches it ("/api/v1/models" -> "/v1/models"; a path
    without the prefix as it is); the API key check and the load tracking read this one."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):]
    return path


def _install_api_key_check(app: FastAPI, keys: list[str]) -> None:
    """Every /v1 route needs `Authorization: Bearer <key>` (as vLLM: /health, /metrics stay open); the scheme's
    case does not matter (RFC 7235: `bearer <key>` too)."""
    expected = [key.encode() for key in keys]

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.method == "OPTIONS" or not _route_path(request.scope).startswith("/v1"):
            return await call_next(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.encode() if scheme.lower() == "bearer" else b""
        if not given or not any(hmac.compare_digest(given, e) for e in expected):
            return JSONResponse({"error": {"message": "Unauthorized: a valid API key is required "
                                                      "(Authorization: Bearer <key>).",
                                           "type": "AuthenticationError", "param": None, "code": 401}},
                                status_code=401)
        return await call_next(request)


__all__ = ["build_app", "FrontendOptions", "OpenAIError", "DEFAULT_LOG_STATS_INTERVAL_S"]


if __name__ == "__main__":  # vLLM's older entry point: `python -m vllm.entrypoints.openai.api_server --model M ...`
    import sys

    from ascendserve.cli.main import main

    sys.exit(main(command=("serve",)))
