"""What one client may ask of the server and how long it may take: bounds SGLang does not set
(ServerLimits) on the body's size (413), the prompts of one /generate (400) and the time to send a
request (disconnected), with the gate every request passes first (API key, model loaded).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from miles_core.engines.embedded.http_requests import _error, _sglang_error

if TYPE_CHECKING:
    from miles_core.engines.embedded.service import EngineService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may ask of the server; SGLang bounds none of these."""

    max_request_bytes: int = 64 << 20
    """A larger body is answered 413, from its Content-Length or once that many bytes arrived."""
    max_prompts_per_request: int = 16384
    """A larger /generate batch is refused (400). Rollouts send batch x samples per engine (1024 in
    the recipes here); a million prompts would hold the engine for minutes."""
    request_read_timeout: float = 30.0
    """Seconds a client has to send a whole request, head and body, counted from connecting or
    from the previous response; a slower one is disconnected."""


OPEN_PATHS = ("/health", "/health_generate")  # no API key needed
BEFORE_LOAD_PATHS = ("/health", "/health_generate", "/server_info", "/get_server_info")


class RequestGate:
    """What every request passes before a route: the API key (as SGLang's --api-key: all but the
    health probes), the model loaded (SGLang answers 503 while starting), then its body read,
    at most `max_bytes` of it: a larger one is answered 413 from its Content-Length before a
    byte of it is read, or once that many bytes arrived (a chunked body); what the client still
    sends, the protocol drops unread. Pure ASGI: Starlette's BaseHTTPMiddleware would turn a
    request left unanswered (its client gone mid-body) into a logged 500."""

    def __init__(self, app: ASGIApp, service: EngineService, max_bytes: int):
        self.app, self.service, self.max_bytes = app, service, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if refusal := self._refusal(scope["path"], headers):
            return await refusal(scope, receive, send)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left, or was cut off for sending too slowly: no one to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": bytes(body), "more_body": False}]
        del body

        async def replay() -> Message:  # the body once, then the client's later messages (a disconnect)
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        key = self.service.api_key
        if key and path not in OPEN_PATHS:
            sent = headers.get(b"authorization", b"")
            if not hmac.compare_digest(sent, f"Bearer {key}".encode()):
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        if not self.service.ready and path not in BEFORE_LOAD_PATHS:
            return _error(503, "model not loaded yet")
        return None

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body over {self.max_bytes} bytes (the server's max_request_bytes)"
        await _sglang_error(413, message)(scope, receive, send)


class TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline to receive each request, head and body. uvicorn
    has none: a client trickling its headers or body a byte at a time would hold its connection
    and the request's task forever. The deadline runs from the connection opening or from the
    previous response; a request received whole is never cut, however long it then runs."""

    read_timeout = 30.0
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        cycle = self.cycle  # None, or done, until a new request's head arrives; more_body until its end
        if (cycle is None or cycle.response_complete or cycle.more_body) and not self.transport.is_closing():
            logger.warning("closing the connection of %s: no whole request in %s s", self.client, self.read_timeout)
            self.transport.close()


def timed_protocol(read_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": read_timeout})
