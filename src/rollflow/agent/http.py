"""An HTTP client for agents' `openai` and `anthropic` clients: httpx's interface over aiohttp's
connection pool.

Both clients send through an `AsyncClient` of httpx, or of `httpx2`, the fork their newer
releases are built on (each accepts only its own). Its default transport (httpcore) walks its
whole connection pool at every request and every response it assigns, which with dozens of
episodes' calls in flight at once costs more CPU than the rest of a call's client side together
(measured in `bench/agent_endpoint.py`). `http_client()` gives an `AsyncClient` of the httpx the
client named by `sdk` is built on, whose transport is aiohttp's pool instead: requests and
responses (streamed ones too) are the same, connection errors and timeouts surface as that
httpx's own exceptions, so the client retries and reports them as it always does. One such client
serves every episode of a run; close it with `aclose()`. This module knows nothing of the
endpoint or of episodes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any, Literal

import aiohttp

SDKS = ("openai", "anthropic")


class _Body:
    """A response body read from aiohttp as it arrives; closing it releases the connection.
    Used as a subclass of the caller's httpx's `AsyncByteStream` (`_body_type`)."""

    def __init__(self, response: aiohttp.ClientResponse, httpx: ModuleType) -> None:
        self._response = response
        self._httpx = httpx

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as err:
            raise self._httpx.ReadTimeout(f"no response data in time: {err}") from err
        except aiohttp.ClientError as err:
            raise self._httpx.ReadError(f"{type(err).__name__}: {err}") from err

    async def aclose(self) -> None:
        self._response.release()


@functools.cache
def _body_type(httpx: ModuleType) -> type[_Body]:
    """`_Body` as a stream of `httpx` (its responses read only their own kind of stream)."""
    return type("_Body", (_Body, httpx.AsyncByteStream), {})


class AiohttpTransport:
    """An httpx transport (of the `httpx` module given, httpx or httpx2) that sends through one
    aiohttp session, made on first use on the caller's loop."""

    def __init__(self, httpx: ModuleType) -> None:
        self._httpx = httpx
        self._body = _body_type(httpx)
        self._session: aiohttp.ClientSession | None = None

    async def handle_async_request(self, request: Any) -> Any:
        httpx = self._httpx
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False, skip_auto_headers=("User-Agent",)
            )
        limits = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, connect=limits.get("connect"), sock_read=limits.get("read"))
        try:
            response = await self._session.request(
                request.method,
                str(request.url),
                headers=list(request.headers.multi_items()),
                data=await request.aread(),
                timeout=timeout,
                allow_redirects=False,
            )
        except TimeoutError as err:
            raise httpx.ConnectTimeout(f"no connection in time: {err}", request=request) from err
        except aiohttp.ClientConnectionError as err:
            raise httpx.ConnectError(f"{type(err).__name__}: {err}", request=request) from err
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.raw_headers]
        return httpx.Response(response.status, headers=headers, stream=self._body(response, httpx), request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AiohttpTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def httpx_of(sdk: str) -> ModuleType:
    """The httpx the client library `sdk` (`openai`, `anthropic`) is built on: httpx or httpx2."""
    if sdk not in SDKS:
        raise ValueError(f"http_client: sdk = {sdk!r}, expected one of {', '.join(SDKS)}")
    try:
        default = importlib.import_module(sdk).DefaultAsyncHttpxClient
    except ImportError:
        raise ValueError(f"http_client: sdk = {sdk!r}, but the {sdk} package is not installed") from None
    for cls in default.__mro__:
        package = cls.__module__.partition(".")[0]
        if cls.__name__ == "AsyncClient" and package in ("httpx", "httpx2"):
            return importlib.import_module(package)
    raise ValueError(f"http_client: {sdk}.DefaultAsyncHttpxClient is no httpx or httpx2 AsyncClient")


def http_client(timeout: float | None = None, *, sdk: Literal["openai", "anthropic"] = "openai") -> Any:
    """An `AsyncClient` on aiohttp's pool for the client library `sdk`:
    `openai.AsyncOpenAI(http_client=http_client())`,
    `anthropic.AsyncAnthropic(http_client=http_client(sdk="anthropic"))`."""
    httpx = httpx_of(sdk)
    return httpx.AsyncClient(transport=AiohttpTransport(httpx), timeout=timeout)
