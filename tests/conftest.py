import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Project-local caches: tests never write to the home folder and CI starts clean.
os.environ.setdefault("PIPELINERL_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))


@pytest.fixture
def nats_server(tmp_path):
    """A real nats-server with JetStream (starts in well under a second)."""
    from pipelinerl_cli.embedded_nats import EmbeddedNats

    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()
