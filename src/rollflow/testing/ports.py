"""A port for a server that a test or benchmark starts itself."""

from __future__ import annotations

import random
import socket

# The kernel hands out ephemeral ports (outgoing connections, `bind(0)`) from 32768 up on Linux.
# A port from `bind(0)` is free only until its socket closes: a gloo pair, one of vLLM's sockets or
# another test worker's connection can take it before the server binds it. Below that range only
# another explicit choice like this one can collide.
_LOW, _HIGH = 20000, 32000


def unused_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, drawn at random below the ephemeral range."""
    for _ in range(100):
        port = random.randrange(_LOW, _HIGH)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no unused port in {_LOW}-{_HIGH} on {host}")
