"""The model shapes the GPU benchmarks time (Qwen2's, by their config.json) with the FLOPs a
training step over them costs and the devices' dense bf16 peaks: pure arithmetic, importable
where only torch is installed (the GPU check's image)."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB = 151_936
# Qwen2-0.5B and Qwen2-1.5B shapes (their config.json); "smoke" is a CPU-sized check of the script.
SIZES: dict[str, dict] = {
    "0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    ),
    "1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    ),
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
    ),
}
# Dense bf16 tensor-core peak, TFLOP/s (vendor data sheets; SXM parts), matched on the device name.
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0}
GB = 1e9  # memory figures are in GB of 10^9 bytes (an H100 "80GB" offers about 85 of them)


@dataclass
class Shape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def of(cls, arch: dict) -> Shape:
        return cls(
            arch["hidden_size"],
            arch["intermediate_size"],
            arch["num_hidden_layers"],
            arch["num_attention_heads"],
            arch["num_key_value_heads"],
            arch["vocab_size"],
        )

    def matmul_params(self) -> int:
        """Weights every token multiplies: q, k, v, o, the gated MLP, and the LM head."""
        head_dim = self.hidden // self.heads
        attn = self.hidden * head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.inter) + self.vocab * self.hidden


def step_flops(shape: Shape, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward = 3 × forward) of one step over sequences of `lengths`."""
    tokens = sum(lengths)
    # Causal scores and weighted values: 2 matmuls × 2 FLOPs × heads·head_dim × s(s+1)/2 pairs
    attention = 2 * shape.layers * shape.hidden * sum(s * (s + 1) for s in lengths)
    return 3 * (2 * shape.matmul_params() * tokens + attention)


def peak_tflops(device: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
