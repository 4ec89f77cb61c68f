"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLM, served by uvicorn."""

import asyncio
import contextlib
import hmac

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


def build_app(engine, models: ServingModels, options: ServerOptions, *, metrics=None, api_keys: list[str] = (),
              cors: dict | None = None, reasoning_parser_cls=None, tool_parser_cls=None,
              log_stats_interval: float | None = None) -> FastAPI:
    """The FastAPI app of one server; `engine` is an AsyncLLM (or a test double with its surface)."""
    app = FastAPI(title="ascendserve OpenAI-compatible server", version=__version__,
                  lifespan=_lifespan(metrics, log_stats_interval))
    chat = OpenAIServingChat(engine, models, options, reasoning_parser_cls, tool_parser_cls)
    completion = OpenAIServingCompletion(engine, models, options)
    tokenization = OpenAIServingTokenization(engine, models, options)
    install_error_handlers(app)
    if api_keys:
        _install_api_key_check(app, list(api_keys))
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

    @app.get("/v1/models")
    async def list_models():
        return models.list_models()

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


def _install_api_key_check(app: FastAPI, keys: list[str]) -> None:
    """Every /v1 route needs `Authorization: Bearer <key>` (as vLLM: /health, /metrics stay open); the scheme's
    case does not matter (RFC 7235: `bearer <key>` too)."""
    expected = [key.encode() for key in keys]

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.method == "OPTIONS" or not request.url.path.startswith("/v1"):
            return await call_next(request)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.encode() if scheme.lower() == "bearer" else b""
        if not given or not any(hmac.compare_digest(given, e) for e in expected):
            return JSONResponse({"error": {"message": "Unauthorized: a valid API key is required "
                                                      "(Authorization: Bearer <key>).",
                                           "type": "AuthenticationError", "param": None, "code": 401}},
                                status_code=401)
        return await call_next(request)


__all__ = ["build_app", "OpenAIError", "DEFAULT_LOG_STATS_INTERVAL_S"]
