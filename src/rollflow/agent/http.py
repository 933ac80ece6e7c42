"""An HTTP client for agents' `openai` clients: httpx's interface over aiohttp's connection pool.

The `openai` client sends through an `httpx.AsyncClient`. Its default transport (httpcore) walks
its whole connection pool at every request and every response it assigns, which with dozens of
episodes' calls in flight at once costs more CPU than the rest of a call's client side together
(measured in `bench/agent_endpoint.py`). `http_client()` gives an `httpx.AsyncClient` whose
transport is aiohttp's pool instead: requests and responses (streamed ones too) are the same,
connection errors and timeouts surface as httpx's own exceptions, so the `openai` client retries
and reports them as it always does. One such client serves every episode of a run; close it
with `aclose()`. This module knows nothing of the endpoint or of episodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx


class _Body(httpx.AsyncByteStream):
    """A response body read from aiohttp as it arrives; closing it releases the connection."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as err:
            raise httpx.ReadTimeout(f"no response data in time: {err}") from err
        except aiohttp.ClientError as err:
            raise httpx.ReadError(f"{type(err).__name__}: {err}") from err

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx requests sent through one aiohttp session (made on first use, on the caller's loop)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
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
        return httpx.Response(response.status, headers=headers, stream=_Body(response), request=request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def http_client(timeout: float | None = None) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` on aiohttp's pool, for `openai.AsyncOpenAI(http_client=...)`."""
    return httpx.AsyncClient(transport=AiohttpTransport(), timeout=timeout)
