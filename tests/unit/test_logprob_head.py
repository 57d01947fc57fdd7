"""The fused, chunked log-prob head equals the reference arithmetic (the LM head's matmul, then
`token_logprobs`) within 1e-5, values and gradients of hidden states and weight, whatever the
chunking; its logits are fp32 from 16-bit operands (the LM head in fp32); its compiled chunk
arithmetic (the GPU's) equals the eager one, here compiled for the CPU; and its peak memory is a
few chunks, not the [tokens, vocabulary] logits."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipelinerl_trainer.logprob_head import chunk_tokens, compiled_by_default, linear_logprobs
from pipelinerl_trainer.loss import token_logprobs


def inputs(n=50, hidden=16, vocab=97, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    return h, w, targets


def reference(h, w, targets, temperature):
    """token_logprobs over whole logits; its entry t + 1 is logits row t at token t + 1, so give it
    a dummy last row and a dummy first token, and take entries 1..n."""
    logits = torch.cat([h @ w.T, torch.zeros(1, w.shape[0], dtype=h.dtype)])
    lp, ent = token_logprobs(logits, torch.cat([targets[:1], targets]), temperature)
    return lp[1:], ent[1:]


@pytest.mark.parametrize("chunk", [1, 7, 50, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_reference(chunk, temperature):
    g = torch.Generator().manual_seed(1)
    up_lp, up_ent = torch.randn(50, generator=g), torch.randn(50, generator=g)  # any upstream gradients
    results = []
    for fused in (True, False):
        h, w, targets = inputs()
        lp, ent = linear_logprobs(h, w, targets, temperature, chunk) if fused else reference(h, w, targets, temperature)
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    assert results[0][0].dtype == torch.float32
    for got, want, name in zip(results[0], results[1], ("logprobs", "entropy", "hidden grad", "weight grad")):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_only_the_gradients_asked_for_flow():
    h, w, targets = inputs()
    lp, _ = linear_logprobs(h, w.detach(), targets, 1.0, 8)  # entropy unused, weight frozen
    lp.sum().backward()
    hr = h.detach().clone().requires_grad_()
    reference(hr, w.detach(), targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(h.grad, hr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["autocast", "weights"])
def test_bf16_operands_give_fp32_logits_not_rounded_to_bf16(how):
    """Under bf16 autocast, or with bf16 weights (DeepSpeed's bf16), the head takes bf16 operands
    and keeps its logits in fp32, as vLLM's fp32 head does: equal to the fp32 product of the same
    bf16 values, and measurably off the bf16-rounded logits (what a bf16 head computes)."""
    h, w, targets = inputs(n=64, hidden=64, vocab=300)
    w = (w.detach() * 2).requires_grad_()  # logits up to a few tens, as a trained model's
    hb, wb = h.detach().bfloat16(), w.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
        if how == "autocast":
            lp, ent = linear_logprobs(h, w, targets, 0.7, 16)
        else:
            h, w = hb.clone().requires_grad_(), wb.clone().requires_grad_()
            lp, ent = linear_logprobs(h, w, targets, 0.7, 16)
    assert lp.dtype == torch.float32
    fp32_head, _ = reference(hb.float(), wb.float(), targets, 0.7)
    bf16_head, _ = reference(hb, wb, targets, 0.7)  # logits rounded to bf16 before the fp32 log-softmax
    torch.testing.assert_close(lp, fp32_head, atol=1e-5, rtol=1e-5)
    assert (lp - bf16_head).abs().max() > 1e-2
    (lp.sum() + ent.sum()).backward()
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert h.grad.isfinite().all() and w.grad.isfinite().all()


def losses_and_grads(compiled, temperature, chunk, autocast=False, n=50, vocab=97):
    g = torch.Generator().manual_seed(2)
    up_lp, up_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    h, w, targets = inputs(n=n, vocab=vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp, ent = linear_logprobs(h, w, targets, temperature, chunk, compiled=compiled)
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.slow  # torch.compile for the CPU: ~15 s the first time
def test_the_compiled_chunk_arithmetic_equals_the_eager_one():
    names = ("logprobs", "entropy", "hidden grad", "weight grad")
    for temperature, chunk in ((1.0, 7), (0.7, 50), (0.7, 13)):  # chunk lengths vary: no recompiling
        got, want = (losses_and_grads(c, temperature, chunk) for c in (True, False))
        for a, b, name in zip(got, want, names):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{name} at T={temperature}, chunk {chunk}")
    # Under bf16 autocast both take the same bf16 operands to fp32 logits.
    got, want = (losses_and_grads(c, 1.0, 16, autocast=True, vocab=300) for c in (True, False))
    for a, b, name in zip(got, want, names):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3, msg=f"{name} under autocast")


def test_only_cuda_compiles_the_chunk_arithmetic_by_default():
    assert not compiled_by_default(torch.device("cpu"))


def test_chunks_hold_a_budget_of_logits():
    assert chunk_tokens(151_936) == (256 << 20) // (4 * 151_936)  # 441 tokens of Qwen2's vocabulary
    assert chunk_tokens(151_936, 512 << 20) == 883  # compiled: no copy of the chunk beside its logits
    assert chunk_tokens(10, budget=16) == 1


class PeakBytes(TorchDispatchMode):
    """Peak bytes of tensor storage made while the mode is on and still alive (checked at every
    op: a storage that died is swept before a new one could reuse its address)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= n
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.live and storage.nbytes():
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def peak_of_loss(fused: bool, n=1024, vocab=4096, chunk=64) -> int:
    h, w, targets = inputs(n=n, hidden=32, vocab=vocab)
    with PeakBytes() as meter:
        lp, ent = linear_logprobs(h, w, targets, 0.7, chunk) if fused else reference(h, w, targets, 0.7)
        (lp.sum() + ent.sum()).backward()
    return meter.peak


def test_peak_memory_of_the_loss_is_a_few_chunks_not_the_logits():
    n, vocab, chunk = 1024, 4096, 64
    logits_bytes = n * vocab * 4  # 16 MiB: one fp32 [tokens, vocabulary] tensor
    fused, ref = peak_of_loss(True, n, vocab, chunk), peak_of_loss(False, n, vocab, chunk)
    assert ref >= 3 * logits_bytes  # the reference holds several full-vocabulary tensors at once
    # The fused head: two chunk buffers (a third as margin), weight- and hidden-sized gradients,
    # per-token vectors.
    bound = 3 * chunk * vocab * 4 + 2 * vocab * 32 * 4 + 2 * n * 32 * 4 + 16 * n * 4
    assert fused <= bound, (fused, bound)
    assert fused * 10 < ref
