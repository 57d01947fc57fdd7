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


# The order the workers take the files in: with `--dist loadfile --no-loadscope-reorder` (make
# test) each worker takes the next file. The longest first (a few minutes each), then the other
# end-to-end runs, which keep both cores busy; beside their ends the operator's tests against the
# emulator, which mostly wait (after them, the cores sat 30-90% idle for 2.5 minutes); the many
# short files last, so no long one starts late and finishes alone.
ORDER = (
    "tests/e2e/test_resume.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_store_faults.py",
    "tests/e2e/",
    "tests/k8s/live/",
    "tests/integration/",
    "tests/unit/",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, prefix in enumerate(ORDER) if path.startswith(prefix)), len(ORDER))

    items.sort(key=rank)  # stable: the order within each rank is the collection's
