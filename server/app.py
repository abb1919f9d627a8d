"""The FastAPI application: routes, API-key check, request limits, CORS, OpenAI-style errors.

Middlewares, outermost first: the Host check (400 for names not allowed), CORS (only with
--allowed-origins), the API key, the request limits (URL 414, headers 431, body size 413, body read
deadline 408), all before any route parses a body, then the response write deadline. Bodies
themselves are checked by `protocol.parse_body` (415, 400).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from hicache.server import anthropic_api, native_api, ollama_api, openai_api, tokenize_api
from hicache.server.config import ServerConfig
from hicache.server.error_styles import styled_body, styled_response
from hicache.server.protocol import APIError, describe_validation
from hicache.server.tokenizer_manager import SchedulerUnavailable, TokenizerManager

logger = logging.getLogger("hicache.server")
VERSION = "0.1.0"
OPEN_PATHS = frozenset({"/health"})
MAX_URL_BYTES = 8 * 1024  # path and query string
MAX_HEADER_BYTES = 32 * 1024  # request line and headers


def create_app(tm: TokenizerManager, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="hicache", version=VERSION, docs_url=None, redoc_url=None)
    app.state.tm = tm
    app.state.config = config
    app.state.started = int(time.time())
    app.state.served_names = list(config.served_model_name or (tm.info.model_name,))
    app.state.model_names = app.state.served_names + (  # clients that send the path as model name
        [tm.runtime_config.model_path] if tm.runtime_config.model_path not in (None, *app.state.served_names) else [])
    for api in (openai_api, anthropic_api, ollama_api, native_api, tokenize_api):
        app.include_router(api.router)
    _install_error_handlers(app)
    app.add_middleware(WriteDeadlineMiddleware, timeout=config.response_write_timeout)
    app.add_middleware(RequestLimitsMiddleware, max_bytes=config.max_request_bytes,
                       read_timeout=config.request_read_timeout)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.origins():  # added last: runs first, so that preflights need no API key
        app.add_middleware(JSONCORSMiddleware, allow_origins=config.origins(), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key", "Anthropic-Version"],
                           max_age=600)
    if config.hosts() is not None:
        app.add_middleware(HostCheckMiddleware, hosts=config.hosts())
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(r: Request, e: APIError):
        return styled_response(r.url.path, e.status, e.message, e.param, e.code, e.type)

    @app.exception_handler(RequestValidationError)
    async def _validation(r: Request, e: RequestValidationError):
        message, param = describe_validation(e.errors())
        return styled_response(r.url.path, 400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, e: StarletteHTTPException):
        return styled_response(r.url.path, e.status_code, str(e.detail), code=_HTTP_CODES.get(e.status_code))

    @app.exception_handler(SchedulerUnavailable)
    async def _unavailable(r: Request, e: SchedulerUnavailable):
        return styled_response(r.url.path, 503, str(e), code="service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(r: Request, e: Exception):
        logger.exception("unhandled error")
        return styled_response(r.url.path, 500, f"internal error: {type(e).__name__}", code="internal_error")


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
CLOSE = (b"connection", b"close")


# ---- pure ASGI middlewares (they must not buffer or wrap streaming responses) ---------------


class ApiKeyMiddleware:
    """The key as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
        if not (bearer_ok | hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
            return await _send_error(scope, send, 401, "Invalid or missing API key: send 'Authorization: Bearer "
                                     "<key>' or 'x-api-key: <key>'.", "authentication_error", "invalid_api_key")
        await self.app(scope, receive, send)


class HostCheckMiddleware:
    """Answers only requests whose Host header names an allowed host: a web page whose domain was
    re-pointed at 127.0.0.1 (DNS rebinding) still sends its own domain as Host."""

    def __init__(self, app, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host")
            if host is not None and _host_name(host.decode("latin-1")) not in self.hosts:
                return await _send_error(scope, send, 400, "this server does not answer for the host named in the Host "
                                         "header (see --allowed-hosts)", "invalid_request_error", "host_not_allowed")
        await self.app(scope, receive, send)


def _host_name(header: str) -> str:
    """The Host header's name, lower case, without port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class WriteDeadlineMiddleware:
    """Bounds each write of a response: a client that stops reading (its socket buffers full)
    makes a write wait; past `timeout` the app is cancelled (a stream's requests are aborted, their
    pages freed) and the connection is closed."""

    def __init__(self, app, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def bounded_send(message):
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                raise _Stalled from None

        try:
            await self.app(scope, receive, bounded_send)
        except _Stalled:
            logger.warning("closed a connection whose client read nothing for %g s", self.timeout)


class _Stalled(Exception):
    pass


class JSONCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered as an OpenAI-style JSON 400."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        return styled_response("", 400, bytes(response.body).decode(), code="cors_refused")


class RequestLimitsMiddleware:
    """414 for a URL over MAX_URL_BYTES, 431 for headers over MAX_HEADER_BYTES (h11 bounds only
    headers that arrive in pieces); for bodies, 413 over `max_bytes` (by Content-Length up front,
    else while reading) and 408 when the whole body has not arrived `read_timeout` seconds after
    the headers. The body is read here, before any route parses it."""

    def __init__(self, app, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") > MAX_URL_BYTES:
            return await _send_error(scope, send, 414, f"the URL exceeds {MAX_URL_BYTES} bytes",
                                     "invalid_request_error", "uri_too_long", close=True)
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return await _send_error(scope, send, 431, f"the request headers exceed {MAX_HEADER_BYTES} bytes",
                                     "invalid_request_error", "headers_too_large", close=True)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)  # no route reads their body; the protocol drops it
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except _TooLarge:
            return await self._too_large(scope, send)
        except asyncio.TimeoutError:
            return await _send_error(scope, send, 408,
                                     f"the request body did not arrive within {self.read_timeout:g} s",
                                     "invalid_request_error", "request_timeout", close=True)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive) -> bytes | None:
        """The whole body; None when the client left first."""
        body, more = bytearray(), True
        while more:  # buffer the (bounded) body so that a chunked upload is capped as well
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_bytes:
                raise _TooLarge
        return bytes(body)

    async def _too_large(self, scope, send) -> None:
        await _send_error(scope, send, 413, f"request body exceeds the limit of {self.max_bytes} bytes",
                          "invalid_request_error", "request_too_large", close=True)


class _TooLarge(Exception):
    pass


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for the disconnect

    return replay


async def _send_error(scope, send, status: int, message: str, type_: str, code: str, close: bool = False) -> None:
    """An error answered by a middleware, in the shape of the path's API family; `close` ends the
    connection after it (the client may still be sending a body nobody reads)."""
    payload = json.dumps(styled_body(scope["path"], status, message, type_, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + ([CLOSE] if close else [])})
    await send({"type": "http.response.body", "body": payload})
