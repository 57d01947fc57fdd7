"""Packing is only correct if attention stays within each sample: packed rows with restarting
position ids must give the same logits as running every sample alone (real HF Qwen2)."""

import torch

from pipelinerl.tiny_model import make_model
from pipelinerl_trainer.loss import token_logprobs


def test_packed_row_equals_separate_samples():
    model = make_model(seed=3).eval()
    seqs = [[3, 4, 5, 12, 6, 7, 8, 15, 9, 1], [5, 5, 12, 9, 15, 4, 1], [7, 12, 7, 15]]
    packed = torch.tensor([sum(seqs, [])])
    positions = torch.tensor([sum([list(range(len(s))) for s in seqs], [])])
    with torch.no_grad():
        # use_cache=False: with a KV cache transformers does not detect packed samples
        together = model(input_ids=packed, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs])
        unpacked = model(input_ids=packed).logits[0]  # without position ids: samples see each other
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unpacked[len(seqs[0]):], alone[len(seqs[0]):], atol=1e-3)
    lp_packed, _ = token_logprobs(together, packed[0], temperature=0.7)
    start = 0
    for s in seqs:
        lp_alone, _ = token_logprobs(alone[start:start + len(s)], torch.tensor(s), temperature=0.7)
        # entry 0 of each sample belongs to the previous sample in the packed row (never trained)
        torch.testing.assert_close(lp_packed[start + 1:start + len(s)], lp_alone[1:], atol=1e-5, rtol=1e-5)
        start += len(s)
