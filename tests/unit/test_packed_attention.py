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
