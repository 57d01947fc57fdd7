"""Listening ports are drawn outside the kernel's ephemeral range (where outgoing connections
take their source ports), so a port handed to a slow-starting service is not taken meanwhile."""

import socket

import pytest

from pipelinerl import ports
from pipelinerl.ports import ephemeral_range, free_port, listen_range


@pytest.mark.parametrize(
    "ephemeral, expected",
    [
        ((32768, 60999), range(10000, 32768)),  # Linux default
        ((49152, 65535), range(10000, 49152)),  # macOS / IANA
        ((10500, 40000), range(40001, 65536)),  # low ephemeral range: listen above it
        ((1024, 65535), range(10000, 65536)),  # no safe side left
    ],
)
def test_listen_range_avoids_the_ephemeral_range(ephemeral, expected):
    assert listen_range(ephemeral) == expected


def test_free_ports_are_distinct_bindable_and_not_ephemeral():
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
            s.listen()


def test_a_port_in_use_is_skipped(monkeypatch):
    busy = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", busy))
        taken.listen()
        monkeypatch.setattr(ports, "_given", set())
        monkeypatch.setattr(ports, "listen_range", lambda _: range(busy, busy + 2))
        assert free_port() == busy + 1  # (assumes busy + 1 is free, as nearly always)
        with pytest.raises(RuntimeError, match="no free port"):
            free_port()  # busy is taken and busy + 1 already given
