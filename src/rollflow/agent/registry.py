"""Who a call to the agents' endpoint is for: the running episodes, their keys, their sessions.

Each episode is registered under an id (its own URL's) with a random key that dies with it. The
key is the only authority at the run's one URL: a call with an episode's key is that episode's,
and an `X-Session-ID` header only chooses among that episode's sessions (naming another
episode's session, or any wrong key, is a 401). A session a program minted for an episode can be
bound to it (`bind`): a call with the run's relay key naming it is that episode's, so the run's
own model client serves every episode. This module serves no request (`rollflow.agent.server`).
"""

from __future__ import annotations

import secrets

from rollflow.agent.episode import AgentEpisode

SESSION_HEADER = "X-Session-ID"
"""The header naming a call's session within its episode (verifiers' clients send each rollout's id)."""


class Refused(Exception):
    """A call refused before or around its turn (no episode, a body that is not JSON, a timeout);
    each dialect answers it in its own error shape."""

    def __init__(self, status: int, message: str = "", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Registry:
    """The endpoint's running episodes by id, their keys and their bound sessions."""

    def __init__(self) -> None:
        self.episodes: dict[str, AgentEpisode] = {}
        """episode id -> the episode, while it runs"""
        self._keys: dict[str, str] = {}
        """api key -> episode id"""
        self._secrets: dict[str, str] = {}
        """episode id -> its api key"""
        self._sessions: dict[str, str] = {}
        """a bound `X-Session-ID` -> episode id (`bind`)"""
        self._bound: dict[str, list[str]] = {}
        """episode id -> its bound sessions (dropped with it)"""
        self.relay_key = secrets.token_urlsafe(24)
        """The key of the run's own model client (a verifiers `Env`'s): with it, a bound session
        selects its episode."""

    def open(self, episode: AgentEpisode) -> str:
        """Register an episode; returns its id."""
        key = secrets.token_hex(8)
        self.episodes[key] = episode
        secret = self._secrets[key] = secrets.token_urlsafe(24)
        self._keys[secret] = key
        return key

    def api_key(self, key: str) -> str:
        """The key that selects episode `key` on the run's one URL."""
        return self._secrets[key]

    def bind(self, session: str, key: str) -> None:
        """Calls naming `session` (a rollout id a program minted for episode `key`: verifiers'
        `Env`s) with the run's `relay_key` are episode `key`'s."""
        self._sessions[session] = key
        self._bound.setdefault(key, []).append(session)

    def close(self, key: str) -> None:
        """The episode has ended: its key and its sessions select nothing from now on."""
        self.episodes.pop(key, None)
        self._keys.pop(self._secrets.pop(key, ""), None)
        for session in self._bound.pop(key, []):
            self._sessions.pop(session, None)

    def key_for(self, secret: str, session: str) -> str:
        """The episode a call carrying `secret` (its API key) and `session` (its `X-Session-ID`,
        or "") is for; `Refused` (401) when the key selects none, or its session is another
        episode's."""
        owner = self._sessions.get(session)
        if secret == self.relay_key and owner is not None:
            return owner
        if not secret:
            raise Refused(401, "no API key: give the episode's key (Authorization: Bearer KEY or x-api-key)",
                           "invalid_api_key")  # fmt: skip
        key = self._keys.get(secret)
        if key is None:
            raise Refused(401, "this API key belongs to no running episode (a wrong key, or its episode ended)",
                           "invalid_api_key")  # fmt: skip
        if owner is not None and owner != key:
            raise Refused(401, f"the {SESSION_HEADER} names a session of another episode than this key's",
                           "invalid_api_key")  # fmt: skip
        return key

    def session_episode(self, session: str | None) -> AgentEpisode | None:
        """The running episode a bound session belongs to (`bind`), if any."""
        key = self._sessions.get(session or "")
        return self.episodes.get(key) if key is not None else None
