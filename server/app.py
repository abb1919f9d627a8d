"""The FastAPI application: routes, API-key check, body size limit, OpenAI-style errors."""
from __future__ import annotations

import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hicache.server import native_api, openai_api
from hicache.server.config import ServerConfig
from hicache.server.protocol import APIError, describe_validation, error_body, error_response
from hicache.server.tokenizer_manager import SchedulerUnavailable, TokenizerManager

logger = logging.getLogger("hicache.server")
VERSION = "0.1.0"
OPEN_PATHS = frozenset({"/health"})


def create_app(tm: TokenizerManager, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="hicache", version=VERSION, docs_url=None, redoc_url=None)
    app.state.tm = tm
    app.state.config = config
    app.state.started = int(time.time())
    names = [config.served_model_name or tm.info.model_name]
    if tm.runtime_config.model_path and tm.runtime_config.model_path not in names:
        names.append(tm.runtime_config.model_path)  # clients that send the path as model name
    app.state.model_names = names
    app.include_router(openai_api.router)
    app.include_router(native_api.router)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # added last: runs first
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        message, param = describe_validation(e.errors())
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), code=_HTTP_CODES.get(e.status_code))

    @app.exception_handler(SchedulerUnavailable)
    async def _unavailable(_: Request, e: SchedulerUnavailable):
        return error_response(503, str(e), code="service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", code="internal_error")


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


# ---- pure ASGI middlewares (they must not buffer or wrap streaming responses) ---------------


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(got, self.expected):
            return await _send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                     "authentication_error", "invalid_api_key")
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`: by Content-Length up front, else while reading."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_error(send, 413, self._message(), "invalid_request_error", "request_too_large")
        body, more = bytearray(), True
        while more:  # buffer the (bounded) body so that a chunked upload is capped as well
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_bytes:
                return await _send_error(send, 413, self._message(), "invalid_request_error", "request_too_large")
        await self.app(scope, _replay(bytes(body), receive), send)

    def _message(self) -> str:
        return f"request body exceeds the limit of {self.max_bytes} bytes"


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for the disconnect

    return replay


async def _send_error(send, status: int, message: str, type_: str, code: str) -> None:
    payload = json.dumps(error_body(message, type_, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
