"""Benchmark 6 (bench/gpu_trainer.py): its model-FLOP count, checked against torch's own FLOP
counter on a real forward + backward of a small Qwen2 model with eager attention. The script
itself runs end to end on CPU in the GPU check's smoke (`tests/unit/test_gpu_check.py`: stock
Hugging Face, plain PyTorch and real DeepSpeed steps on a tiny model), so that it is ready the
day a GPU runs it."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.gpu_shapes import SIZES, Shape, peak_tflops, step_flops


def _model(arch: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(tie_word_embeddings=True, max_position_embeddings=256, attn_implementation="eager", **arch)
    return Qwen2ForCausalLM(config)


def test_matmul_params_are_the_linear_weights_and_the_tied_head():
    arch = SIZES["smoke"]
    model = _model(arch)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: counted once as a parameter,
    assert Shape.of(arch).matmul_params() == linear  # but the head's matmul runs for every token


def test_qwen2_shapes_have_their_published_sizes():
    # Qwen2-0.5B: 494M parameters, Qwen2-1.5B: 1.54B (tied embeddings, rounded as published);
    # matmul weights leave out only norms and biases.
    for size, total in (("0.5B", 494e6), ("1.5B", 1.54e9)):
        n = Shape.of(SIZES[size]).matmul_params()
        assert abs(n / total - 1) < 0.01, (size, n)


def test_step_flops_match_torchs_counter_on_forward_and_backward():
    arch = SIZES["smoke"]
    shape, model = Shape.of(arch), _model(arch)
    s = 48
    ids = torch.randint(2, arch["vocab_size"], (1, s))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).sum().backward()
    # Eager attention computes every score of the s × s square (the mask zeroes half of them);
    # model FLOPs count the causal half only, s(s+1)/2 pairs per head.
    full_square = 2 * 2 * shape.layers * shape.hidden * s * s * 3
    causal = 2 * shape.layers * shape.hidden * s * (s + 1) * 3
    assert counter.get_total_flops() == step_flops(shape, [s]) - causal + full_square


def test_step_flops_sum_over_packed_sequences():
    shape = Shape.of(SIZES["0.5B"])
    assert step_flops(shape, [100, 300]) == step_flops(shape, [100]) + step_flops(shape, [300])
    assert step_flops(shape, [400]) > step_flops(shape, [100, 300])  # attention grows with length²


def test_peak_is_read_off_the_device_name():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("cpu") is None
