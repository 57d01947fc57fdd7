import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Project-local caches: tests never write to the home folder and CI starts clean.
os.environ.setdefault("PIPELINERL_CACHE", str(ROOT / ".cache"))
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
# OpenMP threads sleep rather than spin at their barriers (set before torch loads libgomp; the
# services inherit it). Two pytest workers run beside each other's services, so the cores are
# oversubscribed, and a spinning 2-thread trainer took 2-7 s for a step that takes 0.2-0.6 s on
# a quiet machine: four e2e tests took 205 s under 2 workers with the default and 127 s with this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def nats_server(tmp_path):
    """A real nats-server with JetStream (starts in well under a second)."""
    from pipelinerl_cli.embedded_nats import EmbeddedNats

    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


# The longest files first (a few minutes each under two workers), then the other end-to-end
# runs, then the rest: with `--dist loadfile --no-loadscope-reorder` (make test) each worker
# takes the next file in this order, so no long file starts last and finishes alone.
LONGEST_FIRST = (
    "tests/e2e/test_resume.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_store_faults.py",
    "tests/e2e/",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if path.startswith(prefix)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each rank is the collection's
