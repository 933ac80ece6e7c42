"""The port chosen for a test's own server is free and outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from rollflow.testing import unused_port


def test_unused_port_is_bindable_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {unused_port() for _ in range(20)}
    assert all(1024 < p < low for p in ports), (ports, low)
    assert len(ports) > 1  # drawn at random: two test workers do not walk the same sequence
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_port_in_use_is_skipped(monkeypatch):
    import rollflow.testing.ports as ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, 25001])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
        assert ports.unused_port() == 25001
