"""Listening ports for services started on one machine (local runs, tests, benchmarks).

Binding port 0 gets a port from the kernel's ephemeral range, the range it also draws every
outgoing connection's source port from: by the time a slow-starting service listens on it,
any connect() on the machine may have taken it (seen: the trainer's weight-group port taken
while the generator started, EADDRINUSE). So ports are drawn below that range instead, and
never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT = (32768, 60999)
LOWEST = 10000
_given: set[int] = set()


def listen_range(ephemeral: tuple[int, int]) -> range:
    """Ports outside the ephemeral range `ephemeral` (inclusive bounds) to listen on."""
    lo, hi = ephemeral
    if lo - LOWEST >= 1000:
        return range(LOWEST, lo)
    if hi <= 64535:
        return range(hi + 1, 65536)
    return range(LOWEST, 65536)  # the ephemeral range is nearly everything: no safe side


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, EPHEMERAL_RANGE.read_text().split())
        return lo, hi
    except (OSError, ValueError):  # not Linux: its default is below macOS's 49152-65535 too
        return LINUX_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the ephemeral range, not given out before."""
    ports = listen_range(ephemeral_range())
    for _ in range(200):
        port = random.choice(ports)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port found in {ports.start}-{ports.stop - 1} on {host}")
