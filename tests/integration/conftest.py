"""Shared settings for the integration tests (real vLLM, real process groups, no mocks)."""

from __future__ import annotations

import os

import pytest

from pipelinerl.ports import free_port

# vLLM CPU: a 1 GiB KV cache is plenty for the tiny model and keeps the engine start fast.
# (tests/conftest.py already points VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR under .cache.)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def port() -> int:
    return free_port()
