"""A local run's services listen on loopback only (a laptop's run is not served to its network);
a pod's on every address. torch's rendezvous server listens on every address whatever host it is
given, so the trainer hands it a socket bound to the one asked for."""

from __future__ import annotations

import time
import urllib.request

from listening import listening_addresses  # tests/listening.py
from pydantic import BaseModel

from pipelinerl.ports import free_port
from pipelinerl.runtime import HealthServer
from pipelinerl.weight_group import open_store


def test_the_weight_rendezvous_listens_where_it_is_told():
    port = free_port()
    store = open_store("127.0.0.1", port, True, 5.0)
    assert listening_addresses(port) == {"127.0.0.1"}
    open_store("127.0.0.1", port, False, 5.0).set("k", "v")  # a generator's connection
    assert store.get("k") == b"v"
    everywhere = free_port()
    kept = open_store("0.0.0.0", everywhere, True, 5.0)  # noqa: F841 - served while it lives
    assert listening_addresses(everywhere) & {"0.0.0.0", "::"}
    v6 = free_port()
    kept_v6 = open_store("::1", v6, True, 5.0)  # noqa: F841 - IPv6's loopback, as a pod's listen host may be
    assert listening_addresses(v6) == {"::1"}


def test_the_health_server_listens_where_it_is_told():
    port = free_port()
    HealthServer("test", port, BaseModel, "127.0.0.1").start()
    for _ in range(100):
        if listening_addresses(port):
            break
        time.sleep(0.05)
    assert listening_addresses(port) == {"127.0.0.1"}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
        assert reply.status == 200


def test_a_health_server_that_cannot_listen_fails_its_service():
    """Its port taken: the service's start fails naming it (uvicorn ends its own thread where it
    cannot bind, and the service ran on with no probes and no /status)."""
    import socket

    import pytest

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"could not listen on 127.0.0.1:{port}"):
            HealthServer("test", port, BaseModel, "127.0.0.1").start()
    finally:
        taken.close()
