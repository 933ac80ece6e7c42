"""A remote reward server as a reward function: aiohttp, pooled, bounded, retried with care.

Protocol: `POST url` with a JSON object `{"prompts": [str], "completions": [str], ...columns}`
(one list entry per completion; the columns are the dataset's, e.g. `answer`); the answer is
`{"rewards": [number | null]}` with one entry per completion (null: that one is unscorable).

One `aiohttp.ClientSession` per reward (its connection pool), at most `max_connections`
requests at once, a timeout per request, and retries with exponential backoff only where a
later attempt can succeed: a timeout, a connection failure, HTTP 5xx or 429. A 4xx or an answer
that is not what the protocol says fails at once. After the last attempt the call raises
`RemoteRewardError` with the reason, which makes the samples unscorable (never 0). A bearer
token comes from an environment variable and goes only into the request header.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import Any

from rollflow.errors import ConfigError, RetryableError, RollflowError

log = logging.getLogger(__name__)


class RemoteRewardError(RollflowError):
    """The reward server gave no usable answer; the message says why (never the token)."""


class _Retryable(RetryableError):
    pass


class RemoteReward:
    """Call a reward server like a reward function (async, TRL signature)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        token_env: str = "",
        max_connections: int = 16,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"reward url {url!r}: expected an http:// or https:// URL")
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._token = os.environ.get(token_env) if token_env else None
        if token_env and not self._token:
            raise ConfigError(f"reward url {url}: environment variable {token_env} (token_env) is not set")
        self.max_connections = max_connections
        self._session: Any = None
        self._slots: asyncio.Semaphore | None = None
        self.attempts = 0
        """Requests sent (retries included)."""

    def __repr__(self) -> str:  # the token stays out of every repr
        return f"RemoteReward({self.url!r})"

    async def _open(self) -> Any:
        import aiohttp

        if self._session is None:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=headers)
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._session

    async def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        session = await self._open()
        assert self._slots is not None
        body = {"prompts": prompts, "completions": completions, **columns}
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._slots:
                    return await self._post(session, body, len(completions))
            except _Retryable as err:
                last = str(err)
                log.warning(
                    "reward server %s: %s (attempt %d of %d)", self.url, last, attempt + 1, self.max_retries + 1
                )
        raise RemoteRewardError(f"{self.url}: {last} ({self.max_retries + 1} attempts)")

    async def _post(self, session: Any, body: dict[str, Any], n: int) -> list[float | None]:
        import aiohttp

        self.attempts += 1
        try:
            async with session.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                text = await resp.text()
                if resp.status >= 500 or resp.status == 429:
                    raise _Retryable(f"HTTP {resp.status}")
                if resp.status != 200:
                    raise RemoteRewardError(f"{self.url}: HTTP {resp.status}: {text[:200]}")
        except TimeoutError:
            raise _Retryable(f"no answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as err:
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        return _parse(self.url, text, n)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _parse(url: str, text: str, n: int) -> list[float | None]:
    import json

    try:
        data = json.loads(text)
    except ValueError:
        raise RemoteRewardError(f"{url}: the answer is not JSON: {text[:80]!r}") from None
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if not isinstance(rewards, list) or len(rewards) != n:
        raise RemoteRewardError(f'{url}: expected {{"rewards": [{n} numbers or nulls]}}, got {text[:80]!r}')
    out: list[float | None] = []
    for value in rewards:
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
            out.append(None if value is None else float(value))
        else:
            raise RemoteRewardError(f"{url}: reward {value!r} is not a finite number or null")
    return out
