"""Packing is only correct if attention stays within each sample: the trainer's forward over a
packed row (packed attention, fused log-prob head) must give every sample's tokens the log-probs
of that sample run alone through stock Hugging Face, and the same gradients as stock Hugging
Face over the row (SDPA with its packed-sequence mask, full logits, `token_logprobs`), with
either attention kernel (varlen through a reference kernel on CPU) and with activation
checkpointing. Real HF Qwen2 (the tiny model's architecture)."""

import pytest
import torch
from attention_reference import reference_varlen  # tests/

from pipelinerl.tiny_model import make_model
from pipelinerl_trainer import packed_attention as pa
from pipelinerl_trainer.loss import token_logprobs
from pipelinerl_trainer.model import POST_HEAD_FIELDS, use_policy_forward
from pipelinerl_trainer.packed_attention import Packing, use_packed_attention

# Lengths that land in different padded-length groups, some padded (9 -> 10, 17 -> 20)
SEQS = [
    [3, 4, 5, 12, 6, 7, 8, 15, 9, 1],
    [5, 5, 12, 9, 15, 4, 1],
    [7, 12, 7, 15],
    [9] * 17,
    [4, 12, 9, 15, 6, 6, 1, 3, 2],
    [11],
]
LENGTHS = [len(s) for s in SEQS]


def packed_row(seqs):
    return torch.tensor([sum(seqs, [])]), torch.tensor([sum([list(range(len(s))) for s in seqs], [])])


def trainer_model(seed: int, checkpointing: bool = False):
    model = make_model(seed=seed)
    use_packed_attention(model)
    use_policy_forward(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def use_kernel(monkeypatch, kernel: str) -> None:
    if kernel == "varlen":  # torch's kernel needs CUDA: its adapter runs here through the reference
        monkeypatch.setattr(pa, "_varlen", lambda: (reference_varlen, {"window_size", "enable_gqa", "scale"}))
        monkeypatch.setattr(pa, "kernel_for", lambda device, dtype: "varlen")


def no_stock_sdpa(monkeypatch):
    """Make sure the trainer's path is the one that runs: the stock attention fails the test."""
    import transformers.integrations.sdpa_attention as stock

    def fail(*args, **kwargs):
        raise AssertionError("fell back to the stock SDPA path")

    monkeypatch.setattr(stock, "sdpa_attention_forward", fail)


@pytest.mark.parametrize("kernel", ["grouped", "varlen"])
def test_packed_row_equals_separate_samples(kernel, monkeypatch):
    model = trainer_model(seed=3).eval()
    ids, positions = packed_row(SEQS)
    with torch.no_grad(), monkeypatch.context() as m:
        use_kernel(m, kernel)
        no_stock_sdpa(m)
        lp, ent = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS), temperature=0.7)
    stock = make_model(seed=3).eval()
    start = 0
    with torch.no_grad():
        for s in SEQS:
            alone = stock(input_ids=torch.tensor([s])).logits[0]
            lp_alone, ent_alone = token_logprobs(alone, torch.tensor(s), temperature=0.7)
            # entry 0 of each sample belongs to the previous sample in the packed row (never trained)
            torch.testing.assert_close(lp[start + 1 : start + len(s)], lp_alone[1:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent[start + 1 : start + len(s)], ent_alone[1:], atol=1e-5, rtol=1e-5)
            start += len(s)
        unpacked = stock(input_ids=ids).logits[0]  # without position ids: samples see each other
    assert not torch.allclose(token_logprobs(unpacked, ids[0], 0.7)[0], lp, atol=1e-3)


@pytest.mark.parametrize("kernel, checkpointing", [("grouped", False), ("varlen", False), ("grouped", True)])
def test_trainer_forward_gradients_equal_stock(kernel, checkpointing, monkeypatch):
    stock, model = make_model(seed=4).train(), trainer_model(4, checkpointing).train()
    assert model.is_gradient_checkpointing == checkpointing
    ids, positions = packed_row(SEQS)
    g = torch.Generator().manual_seed(0)
    up_lp, up_ent = torch.rand(ids.shape[1], generator=g), torch.rand(ids.shape[1], generator=g)
    # Stock HF masks the packed row from its position ids (SDPA over the whole row, full logits).
    logits = stock(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    lp, ent = token_logprobs(logits, ids[0], 0.7)
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    with monkeypatch.context() as m:
        use_kernel(m, kernel)
        lp2, ent2 = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS), temperature=0.7)
        ((lp2 * up_lp).sum() + (ent2 * up_ent).sum()).backward()
    torch.testing.assert_close(lp2, lp, atol=1e-5, rtol=1e-5)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    for (name, a), b in zip(stock.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_without_a_packing_the_model_is_stock():
    model, stock = trainer_model(seed=5).eval(), make_model(seed=5).eval()
    ids = torch.tensor([SEQS[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_models_that_transform_their_logits_are_refused():
    model = make_model(seed=0)
    setattr(model.config, POST_HEAD_FIELDS[0], 30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        use_policy_forward(model)


@pytest.mark.slow
def test_compiled_mlps_and_norms_give_the_same_gradients_and_compile_once():
    """trainer.compile: the MLPs and norms compiled with dynamic shapes (inductor on CPU here)."""
    from torch._dynamo.utils import counters

    from pipelinerl_trainer.model import compile_elementwise

    eager, compiled = trainer_model(4).train(), trainer_model(4).train()
    compile_elementwise(compiled)
    for model in (eager, compiled):
        ids, positions = packed_row(SEQS)
        lp, ent = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS), temperature=0.7)
        (lp.sum() + ent.sum()).backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        # Compiled kernels sum in another order than eager ones (and inductor's code differs by
        # CPU: AVX2 here, AVX-512 elsewhere), so float32 rounding differs by ~1e-7 of a tensor's
        # scale: on the embeddings' gradient (entries up to ~90, each a sum over the row) that is
        # ~4e-5 on entries near 0, past any fixed atol. The bounds scale with the gradient; a
        # wrong gradient is off by far more than 1e-4 of its norm.
        diff = (b.grad - a.grad).abs()
        assert diff.norm() <= 1e-4 * a.grad.norm(), name
        assert diff.max() <= 1e-5 * a.grad.abs().max(), name
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    ids, positions = packed_row(SEQS[:3])  # another row length: the same compiled graphs
    compiled(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS[:3]), temperature=0.7)[
        0
    ].sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs
