"""Middleware that `--middleware` loads in tests/server/test_frontend_flags.py: one ASGI class, one function."""


class TagResponses:
    """Adds `x-tag-class: 1` to every HTTP response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-tag-class", b"1")]}
            await send(message)
        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


async def tag_function(request, call_next):
    """Adds `x-tag-function: 1` and `x-root-path: <the ASGI root_path>` to every response."""
    response = await call_next(request)
    response.headers["x-tag-function"] = "1"
    response.headers["x-root-path"] = request.scope.get("root_path", "")
    return response


NOT_CALLABLE = 3
