"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, and the app's exception handlers.

Every bad input must end here as a 4xx with a message naming the field; the catch-all 500 exists only
for bugs, and the tests check that bad inputs never reach it.
"""

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ascendserve.logger import init_logger

logger = init_logger(__name__)

# OpenAI's error `type` per status (what the official client maps to its exception classes).
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
          499: "ClientClosedRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error to answer with an OpenAI error body; raise it anywhere in a handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The JSON body of an error."""
    kind = _TYPES.get(status) or _phrase(status).replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def error_response(message: str, status: int = 400, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse holding an OpenAI error."""
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def format_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic/FastAPI errors: names each bad field and says why."""
    parts, first_param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return f"Invalid JSON in the request body: {detail}".rstrip(": "), None
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        # A union of models (tool_choice, tokenize) reports the branch name; keep the field path only.
        loc = [p for p in loc if not _is_branch_name(p)]
        if not loc and err.get("type") in _BODY_ERRORS:
            parts.append(_body_problem(err))
            continue
        param = ".".join(loc) or _leading_field(message)
        first_param = first_param or param
        if param and err.get("type") == "missing":
            parts.append(f"'{param}' is a required field")
        elif loc:
            parts.append(f"'{param}': {message} (got {_short(err.get('input'))})")
        else:
            parts.append(message)
    # one line per distinct problem, in order
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique) or "invalid request", first_param


# What pydantic reports when the body as a whole is not an object (FastAPI hands a non-JSON body over as bytes).
_BODY_ERRORS = {"missing", "model_attributes_type", "model_type", "dict_type"}
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _body_problem(err: dict) -> str:
    """The message for a body that is absent, not JSON, or JSON but not an object."""
    value = err.get("input")
    if err.get("type") == "missing":
        got = "no body"
    elif isinstance(value, bytes | bytearray):
        got = "a body that is not application/json"
    else:
        got = f"{_JSON_KINDS.get(type(value), type(value).__name__)} in JSON"
    return f"The request body must be a JSON object, sent with Content-Type: application/json; got {got}."


def _leading_field(message: str) -> str | None:
    """The request field a model-level message starts with ("tool_choice names ..." -> "tool_choice")."""
    first = message.split(" ", 1)[0].rstrip(":,.")  # "guided_choice: structured outputs: ..." too
    return first if "_" in first and first.replace("_", "").isalpha() and first.islower() else None


def _is_branch_name(part: str) -> bool:
    return part[:1].isupper() or part.startswith(("literal[", "function-", "list[", "str", "int", "dict[", "bool"))


def _short(value) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# vLLM's endpoints this server does not have, by path prefix: a 404 that says so, and what to use, rather than
# "Not Found", which reads like a wrong URL or --root-path.
UNSERVED_ENDPOINTS = {
    "/v1/responses": "the Responses API is not implemented; use /v1/chat/completions (the same messages, tools and "
                     "reasoning)",
    "/v1/embeddings": "pooling models (embeddings, classification, scores) are not implemented; this server generates",
    "/pooling": "pooling models are not implemented; this server generates",
    "/classify": "pooling models are not implemented; this server generates",
    "/v1/classify": "pooling models are not implemented; this server generates",
    "/score": "pooling models are not implemented; this server generates",
    "/v1/score": "pooling models are not implemented; this server generates",
    "/rerank": "pooling models are not implemented; this server generates",
    "/v1/rerank": "pooling models are not implemented; this server generates",
    "/v2/rerank": "pooling models are not implemented; this server generates",
    "/v1/audio": "speech models are not implemented",
    "/v1/load_lora_adapter": "LoRA adapters are not implemented",
    "/v1/unload_lora_adapter": "LoRA adapters are not implemented",
    "/sleep": "sleep mode is not implemented",
    "/wake_up": "sleep mode is not implemented",
    "/is_sleeping": "sleep mode is not implemented",
    "/tokenizer_info": "the tokenizer-info endpoint is not implemented; /tokenize and /detokenize are served",
}


def _unserved_endpoint(path: str) -> str | None:
    for prefix, why in UNSERVED_ENDPOINTS.items():
        if path == prefix or path.startswith(prefix + "/") or path.endswith(prefix):  # endswith: under a root path
            return why
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Map OpenAIError, validation errors, HTTP errors and unexpected exceptions to OpenAI bodies."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError):
        return error_response(exc.message, exc.status, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = format_validation_error(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and (why := _unserved_endpoint(request.url.path)):
            message = f"{request.url.path} is not served here: {why}"
        return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("Unexpected error while serving %s %s", request.method, request.url.path)
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
