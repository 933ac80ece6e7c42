"""Sockets the project opens listen on the loopback interface unless told otherwise."""

from __future__ import annotations

from pathlib import Path

from rollflow.weight_sync.gloo import GlooSender

LISTEN = "0A"


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net shows them) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == LISTEN:
                found.append(address)
    return found


def test_the_gloo_weight_sync_rendezvous_listens_on_loopback_only():
    sender = GlooSender(timeout_s=5)
    try:
        assert listening(sender.port) == ["0100007F"]  # 127.0.0.1, and no wildcard socket
    finally:
        sender.close()
