"""Random-init Qwen2-architecture models of a few sizes, saved with the tiny character tokenizer,
and the project-local caches the tests use (so benchmarks never write to the home folder)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pipelinerl import tiny_model
from pipelinerl.contracts import Env

ROOT = Path(__file__).resolve().parents[1]

# head_dim = hidden / heads = 64 everywhere (vLLM's CPU attention wants it); vocab stays 32 and
# embeddings are tied, so nearly all parameters sit in the transformer layers.
SIZES: dict[str, dict] = {
    "3M": dict(tiny_model.ARCH),
    "30M": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4
    ),
    "120M": dict(
        hidden_size=768, intermediate_size=2304, num_hidden_layers=18, num_attention_heads=12, num_key_value_heads=4
    ),
}


def project_caches() -> None:
    os.environ.setdefault(Env.CACHE, str(ROOT / ".cache"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))


def save_model(path: Path, size: str, seed: int = 0, max_positions: int = 2048) -> tuple[str, int]:
    """A random `size` model in `path`; returns (path, parameter count).

    The eos row of the tied embedding is zeroed: eos then has logit 0 while the best token's is
    > 0, so greedy requests never stop early and run to max_tokens (a known length)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tok = tiny_model.make_tokenizer()
    arch = SIZES[size] | {"max_position_embeddings": max_positions, "rope_theta": 10000.0}
    config = Qwen2Config(
        vocab_size=tiny_model.VOCAB_SIZE,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        dtype="float32",
        **arch,
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[tok.eos_token_id] = 0.0
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())
