"""Packed-row attention: both kernels equal attention over the whole row under a block-diagonal
causal mask (the masked reference), GQA included. The grouped kernel runs here as the trainer
runs it on CPU; the varlen kernel's adapter runs here against a reference implementation of
torch's `varlen_attn` contract, in both of the signatures torch has shipped (the kernel itself
is checked on a GPU by bench/gpu_check.sh)."""

import pytest
import torch

from attention_reference import masked_reference, reference_varlen, reference_varlen_2_10  # tests/
from pipelinerl_trainer import packed_attention as pa
from pipelinerl_trainer.packed_attention import (
    Packing,
    grouped_attention,
    length_groups,
    packed_attention,
    padded_length,
    varlen_attention,
)

LENGTHS = [13, 14, 12, 3, 1, 9, 17, 40]  # several length groups, some padded (9 -> 10, 17 -> 20)


def test_padded_length_pads_at_most_a_quarter():
    assert [padded_length(n) for n in range(1, 9)] == list(range(1, 9))  # short: exact
    assert padded_length(13) == 14 and padded_length(1000) == 1024 and padded_length(1024) == 1024
    for n in range(1, 5000):
        assert n <= padded_length(n) <= n * 1.25


def test_length_groups_collect_sequences_of_a_padded_length():
    assert length_groups([13, 14, 12, 3]) == {14: [(0, 13), (13, 14)], 12: [(27, 12)], 3: [(39, 3)]}


def test_packing_holds_the_boundaries_and_a_plan_that_visits_every_token_once():
    p = Packing.of(LENGTHS)
    assert p.cu_seqlens.tolist() == [0, 13, 27, 39, 42, 43, 52, 69, 109] and p.cu_seqlens.dtype == torch.int32
    assert p.max_length == 40
    groups, order = p.grouped_plan()
    assert sorted(order.tolist()) == list(range(sum(LENGTHS)))
    assert sum(len(real) for _, real in groups) == sum(LENGTHS)
    assert p.grouped_plan() is p.grouped_plan()  # built once, for every layer


def qkv(heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENGTHS)
    return (
        torch.randn(heads, t, dim, generator=g),
        torch.randn(kv_heads, t, dim, generator=g),
        torch.randn(kv_heads, t, dim, generator=g),
    )


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_grouped_kernel_equals_the_masked_row(kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    got = grouped_attention(q, k, v, Packing.of(LENGTHS), scale=0.3)
    torch.testing.assert_close(got, masked_reference(q, k, v, LENGTHS, scale=0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [reference_varlen, reference_varlen_2_10])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_adapter_equals_the_masked_row(kernel, kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    got = varlen_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), Packing.of(LENGTHS), scale=0.3, kernel=kernel
    )
    torch.testing.assert_close(got, masked_reference(q, k, v, LENGTHS, scale=0.3), atol=1e-5, rtol=1e-5)


class Module(torch.nn.Module):
    training = False


def test_attention_function_takes_one_packed_row_or_one_plain_sequence(monkeypatch):
    q, k, v = (t[None] for t in qkv())
    for kernel in ("grouped", "varlen"):
        if kernel == "varlen":  # the adapter's path on CPU, through the reference
            monkeypatch.setattr(pa, "_varlen", lambda: (reference_varlen, {"window_size", "enable_gqa", "scale"}))
            monkeypatch.setattr(pa, "kernel_for", lambda device, dtype: "varlen")
        out, weights = packed_attention(Module(), q, k, v, None, scaling=0.3, packing=Packing.of(LENGTHS))
        assert out.shape == (1, sum(LENGTHS), 4, 8) and weights is None
        torch.testing.assert_close(out[0], masked_reference(q[0], k[0], v[0], LENGTHS, 0.3), atol=1e-5, rtol=1e-5)
    plain, _ = packed_attention(Module(), q, k, v, None, scaling=0.3)  # no packing: one causal sequence
    torch.testing.assert_close(plain[0], masked_reference(q[0], k[0], v[0], [sum(LENGTHS)], 0.3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one packed row"):
        packed_attention(Module(), torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), None)
    with pytest.raises(ValueError, match="no padding mask"):
        packed_attention(Module(), q, k, v, torch.ones(1, 1, 109, 109, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="sliding window"):
        packed_attention(Module(), q, k, v, None, sliding_window=16)


def test_the_kernel_is_varlen_only_where_flash_attention_runs():
    assert pa.kernel_for(torch.device("cpu"), torch.bfloat16) == "grouped"
    assert pa.kernel_for(torch.device("cuda"), torch.float32) == "grouped"  # flash has no fp32
    expected = "varlen" if pa._varlen() is not None else "grouped"
    assert pa.kernel_for(torch.device("cuda"), torch.bfloat16) == expected


def test_the_compute_dtype_is_autocasts_where_autocast_is_on():
    x = torch.zeros(2, dtype=torch.float32)
    assert pa.compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pa.compute_dtype(x) == torch.bfloat16
        assert pa.compute_dtype(x.to(torch.float16)) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert pa.compute_dtype(x) == torch.float32


def test_fp32_weights_under_bf16_autocast_reach_the_varlen_kernel_in_bf16(monkeypatch):
    """The benchmark's `plain` side (fp32 weights, bf16 autocast): Hugging Face's rotary embedding
    hands attention fp32 q and k. The kernel is chosen, and fed, by autocast's dtype, so on a GPU
    this takes the varlen kernel, not the grouped SDPA path. Here the CPU stands in for CUDA:
    the choice treats it as the GPU would, and the varlen kernel is the reference."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl_trainer.model import use_policy_forward

    chosen, fed = [], []

    def kernel_for(device, dtype):  # CUDA's rule, on the CPU
        chosen.append(dtype)
        return "varlen" if dtype in (torch.bfloat16, torch.float16) else "grouped"

    def kernel(q, k, v, *args, **kwargs):
        fed.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(pa, "kernel_for", kernel_for)
    monkeypatch.setattr(pa, "_varlen", lambda: (kernel, {"window_size", "enable_gqa", "scale"}))
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)  # fp32 weights
    pa.use_packed_attention(model)
    use_policy_forward(model)
    ids = torch.randint(2, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[p for n in LENGTHS for p in range(n)]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS))
    assert chosen == [torch.bfloat16] * 2  # one choice per layer, by autocast's dtype (was fp32)
    assert fed == [(torch.bfloat16,) * 3] * 2  # the kernel gets q, k, v in bf16 (it does not autocast)
    # The same as the grouped SDPA path under the same autocast (bf16 rounding apart).
    monkeypatch.setattr(pa, "kernel_for", lambda device, dtype: "grouped")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped, _ = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS))
    torch.testing.assert_close(logprobs, grouped, atol=3e-2, rtol=3e-2)
