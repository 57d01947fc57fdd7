"""Shared settings for the integration tests (real vLLM, real process groups, no mocks)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pipelinerl.ports import free_port

# vLLM CPU: a 1 GiB KV cache is plenty for the tiny model and keeps the engine start fast.
# (tests/conftest.py already points VLLM_CACHE_ROOT / TORCHINDUCTOR_CACHE_DIR under .cache.)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def tiny_qwen2(tmp_path) -> Path:
    """A randomly initialised two-layer Qwen2 saved in Hugging Face format (seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tmp_path / "model"
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    ).save_pretrained(path)
    return path
