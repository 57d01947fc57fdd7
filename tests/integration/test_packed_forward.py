"""Packing is only correct if attention stays within each sample: packed rows with restarting
position ids must give the same logits as running every sample alone (real HF Qwen2), with
Hugging Face's stock SDPA (row mask) and with the trainer's packed-row attention; the latter
must also give the same gradients."""

import pytest
import torch

from pipelinerl.tiny_model import make_model
from pipelinerl_trainer.loss import token_logprobs
from pipelinerl_trainer.packed_attention import use_packed_attention

# Lengths that land in different padded-length groups, some padded (9 -> 10, 17 -> 20)
SEQS = [[3, 4, 5, 12, 6, 7, 8, 15, 9, 1], [5, 5, 12, 9, 15, 4, 1], [7, 12, 7, 15], [9] * 17, [4, 12, 9, 15, 6, 6, 1, 3, 2],
        [11]]


def packed_row(seqs):
    return torch.tensor([sum(seqs, [])]), torch.tensor([sum([list(range(len(s))) for s in seqs], [])])


def no_stock_sdpa(monkeypatch):
    """Make sure the packed path is the one that runs: the stock fallback fails the test."""
    import transformers.integrations.sdpa_attention as stock

    def fail(*args, **kwargs):
        raise AssertionError("fell back to the stock SDPA path")
    monkeypatch.setattr(stock, "sdpa_attention_forward", fail)


@pytest.mark.parametrize("attention", ["stock", "packed"])
def test_packed_row_equals_separate_samples(attention, monkeypatch):
    model = make_model(seed=3).eval()
    if attention == "packed":
        use_packed_attention(model)
    packed, positions = packed_row(SEQS)
    with torch.no_grad():
        if attention == "packed":
            with monkeypatch.context() as m:
                no_stock_sdpa(m)
                together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
        else:  # use_cache=False: with a KV cache transformers does not detect packed samples
            together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in SEQS])
        unpacked = model(input_ids=packed).logits[0]  # without position ids: samples see each other
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unpacked[len(SEQS[0]):], alone[len(SEQS[0]):], atol=1e-3)
    lp_packed, _ = token_logprobs(together, packed[0], temperature=0.7)
    start = 0
    for s in SEQS:
        lp_alone, _ = token_logprobs(alone[start:start + len(s)], torch.tensor(s), temperature=0.7)
        # entry 0 of each sample belongs to the previous sample in the packed row (never trained)
        torch.testing.assert_close(lp_packed[start + 1:start + len(s)], lp_alone[1:], atol=1e-5, rtol=1e-5)
        start += len(s)


def test_packed_attention_gradients_equal_stock():
    stock, packed_model = make_model(seed=4).train(), make_model(seed=4).train()
    use_packed_attention(packed_model)
    ids, positions = packed_row(SEQS)
    weights = torch.rand(ids.shape[1])  # a loss that weighs every position differently
    for model in (stock, packed_model):
        lp, _ = token_logprobs(model(input_ids=ids, position_ids=positions, use_cache=False).logits[0], ids[0], 1.0)
        (lp * weights).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in packed_model.parameters())
    for (name, a), b in zip(stock.named_parameters(), packed_model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
