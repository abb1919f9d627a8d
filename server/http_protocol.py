"""uvicorn's h11 protocol with what `hicache serve` needs on top: read deadlines, a connection cap,
JSON errors for malformed HTTP.

- The headers of each request must be complete `read_timeout` seconds after the connection opened
  or, on a kept-alive connection, after the request's first byte; otherwise the server answers 408
  (when part of a request came) and closes the connection. uvicorn itself has no such deadline:
  its keep-alive timer runs only between requests and stops at the first byte, so a client that
  sends its headers slowly holds its socket for ever. (The body's deadline is the app's
  `RequestLimitsMiddleware`, which can answer with a JSON 408 in the request's cycle.)
- Requests h11 rejects get an OpenAI-style JSON error with h11's status where it gives a 4xx:
  431 for headers over `h11_max_incomplete_event_size` bytes, 414 when the request line alone is
  that long, else 400 (uvicorn answers a plain-text 400 to all).
- At most `max_connections` connections are open; the next ones get 503 and are closed.
- A request body that nobody read by the end of the response (a route that reads none, an error
  answered early) is not read either: the connection is closed instead of draining it.
"""
from __future__ import annotations

import asyncio
import http
import json
import resource

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from hicache.server.protocol import error_body

MAX_CONNECTIONS = 10_000
FD_RESERVE = 128  # file descriptors kept for the scheduler sockets, model files, logs


def guarded_protocol(read_timeout: float, max_connections: int | None = None) -> type[H11Protocol]:
    """The protocol class to give uvicorn as `http=`."""
    cap = max_connections if max_connections is not None else connection_cap()
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"read_timeout": read_timeout, "max_connections": cap})


def connection_cap() -> int:
    """MAX_CONNECTIONS, or fewer where the process may not open that many files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - FD_RESERVE))


class _Connection(h11.Connection):
    """h11's connection, keeping the error it raised on received data (uvicorn drops it)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


class GuardedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    max_connections: int = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(h11.SERVER, size if size is not None else DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self._headers_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._answer_and_close(503, "too many open connections; retry later", "too_many_connections")
            return
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_headers_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._close()  # the rest of a body nobody reads

    def send_400_response(self, msg: str) -> None:
        error = self.conn.last_error
        hint = error.error_status_hint if error is not None else 400
        status = hint if 400 <= hint < 500 else 400
        if status == 431 and b"\n" not in self.conn.trailing_data[0]:
            self._answer_and_close(414, "the request line (method and URL) is too long", "uri_too_long")
        elif status == 431:
            self._answer_and_close(431, "the request headers are too large", "headers_too_large")
        else:
            self._answer_and_close(status, f"invalid HTTP request: {error or msg}", "invalid_http")

    # ---- the headers' deadline ----------------------------------------------------------------

    def _watch_headers(self) -> None:
        """Run the deadline while a request's headers are awaited (not between kept-alive
        requests: uvicorn's keep-alive timer covers those until their first byte)."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._headers_timer is None:
            self._headers_timer = self.loop.call_later(self.read_timeout, self._headers_late)
        elif not waiting:
            self._stop_headers_timer()

    def _stop_headers_timer(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:
            self._answer_and_close(408, f"the request headers did not arrive within {self.read_timeout:g} s",
                                   "request_timeout")
        else:
            self._close()

    # ---- answering outside a request's cycle ---------------------------------------------------

    def _answer_and_close(self, status: int, message: str, code: str) -> None:
        kind = "service_unavailable" if status == 503 else "invalid_request_error"
        payload = json.dumps(error_body(message, kind, None, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        reason = http.HTTPStatus(status).phrase.encode()
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=payload),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had started: nothing more can be said
            pass
        self.transport.close()

    def _close(self) -> None:
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()
