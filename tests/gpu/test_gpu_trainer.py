"""The trainer's GPU path on a real GPU (skipped where none is visible; `bash bench/gpu_check.sh`
runs them with the GPU benchmark): torch's variable-length flash attention is the kernel that
runs and equals the masked row, the LM head's one-GEMM fp32 logits equal the cast-up ones, the
compiled log-prob head equals the eager one, the trainer's
forward in bf16 equals stock Hugging Face's, and the micro-batch loop runs under
`torch.cuda.set_sync_debug_mode("error")`."""

import pytest
import torch
from attention_reference import masked_reference  # tests/

from pipelinerl_trainer.packed_attention import Packing, kernel_for, varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LENGTHS = [700, 13, 1, 300, 2048, 96, 511, 7]
CUDA = torch.device("cuda")


def test_varlen_flash_attention_runs_and_equals_the_masked_row():
    assert kernel_for(CUDA, torch.bfloat16) == "varlen", "torch.nn.attention.varlen is missing from this torch"
    g = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENGTHS)
    q = torch.randn(14, t, 64, generator=g, device="cuda")
    k, v = (torch.randn(2, t, 64, generator=g, device="cuda") for _ in range(2))
    leaves = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    ref = [x.detach().float().requires_grad_() for x in leaves]  # the same bf16 inputs, in fp32
    want = masked_reference(*ref, LENGTHS)  # fp32, the whole row masked
    got = varlen_attention(*(x.transpose(0, 1) for x in leaves), Packing.of(LENGTHS, CUDA), scale=None)
    torch.testing.assert_close(got.float(), want.detach(), atol=2e-2, rtol=2e-2)
    got.float().square().sum().backward()
    want.square().sum().backward()
    # bf16 gradients summed over many tokens (dk, dv also over the 7 query heads per KV head):
    # compared as a whole, relative to their size
    for a, b, name in zip(leaves, ref, "qkv"):
        assert (err := relative_error(a.grad, b.grad)) < 1e-2, f"d{name}: relative error {err:.2e}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_the_lm_heads_fp32_gemm_over_bf16_operands_equals_the_cast_up_product():
    """CUDA's GEMM writes fp32 logits from bf16 operands (`torch.mm(out_dtype=)`, vLLM's fp32
    head too): the cast-up product of the same values to fp32 summation order, far closer than
    a bf16 head."""
    from pipelinerl_trainer.logprob_head import head_logits, head_weight

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(512, 896, generator=g, device="cuda").bfloat16()
    w = (torch.randn(151_936, 896, generator=g, device="cuda") * 0.05).bfloat16()
    assert head_weight(w, torch.bfloat16).dtype == torch.bfloat16  # no fp32 copy of the weight
    got = head_logits(h, head_weight(w, torch.bfloat16))
    assert got.dtype == torch.float32
    want = h.double() @ w.double().T
    assert (err := relative_error(got, want)) < 1e-5, f"fp32 head: relative error {err:.2e}"
    assert relative_error((h @ w.T).float(), want) > 10 * err  # a bf16 head rounds every logit


def test_the_heads_weight_gradient_over_bf16_operands_is_summed_in_fp32():
    """The backward adds each chunk's grad.T @ h into the fp32 gradient in one GEMM
    (`add_weight_grad`): the product of the same values to fp32 summation order, not a bf16
    product rounded before it is added (as it was)."""
    from pipelinerl_trainer.logprob_head import add_weight_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    grad = (torch.randn(883, 151_936, generator=g, device="cuda") * 1e-3).bfloat16()
    h = torch.randn(883, 896, generator=g, device="cuda").bfloat16()
    acc = torch.randn(151_936, 896, generator=g, device="cuda") * 1e-2
    want = acc.double() + grad.double().T @ h.double()
    rounded = acc + (grad.T @ h).float()  # the bf16 product, rounded, then added
    add_weight_grad(acc, grad, h)
    assert acc.dtype == torch.float32
    assert (err := relative_error(acc, want)) < 1e-5, f"fp32 sum: relative error {err:.2e}"
    assert relative_error(rounded, want) > 10 * err


def test_the_compiled_log_prob_head_is_the_default_and_equals_the_eager_one():
    from pipelinerl_trainer.logprob_head import compiled_by_default, linear_logprobs

    assert compiled_by_default(CUDA), "Triton is missing: the head's chunk arithmetic would run eager"
    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 2500, 896, 151_936  # Qwen2-0.5B's head; compiled: two chunks of 883 tokens and a shorter one
    h = torch.randn(n, hidden, generator=g, device="cuda")
    w = torch.randn(vocab, hidden, generator=g, device="cuda") * 0.05
    targets = torch.randint(0, vocab, (n,), generator=g, device="cuda")
    up_lp, up_ent = torch.randn(2, n, generator=g, device="cuda")
    results = []
    for compiled in (True, False):
        hh, ww = (x.clone().requires_grad_() for x in (h, w))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = linear_logprobs(hh, ww, targets, 0.7, compiled=compiled)
        ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for a, b, name in zip(*results, ("logprobs", "entropy", "hidden grad", "weight grad")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert (err := relative_error(a, b)) < 1e-2, f"{name}: relative error {err:.2e}"


def small_model(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
    )


def packed(lengths, vocab=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (1, sum(lengths)), generator=g)
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    return ids.cuda(), positions.cuda()


def test_trainer_forward_in_bf16_equals_stock_hugging_face():
    from pipelinerl_trainer.loss import token_logprobs
    from pipelinerl_trainer.model import use_policy_forward
    from pipelinerl_trainer.packed_attention import use_packed_attention

    stock = small_model().cuda().bfloat16().train()
    model = small_model().cuda().bfloat16().train()
    use_packed_attention(model)
    use_policy_forward(model)
    ids, positions = packed(LENGTHS)
    logits = stock(input_ids=ids, position_ids=positions, use_cache=False).logits[0]  # SDPA, packed-row mask
    lp, ent = token_logprobs(logits, ids[0], 0.7)
    (lp.sum() + ent.sum()).backward()
    lp2, ent2 = model(input_ids=ids, position_ids=positions, packing=Packing.of(LENGTHS, CUDA), temperature=0.7)
    (lp2.sum() + ent2.sum()).backward()
    starts = torch.tensor([0] + LENGTHS).cumsum(0)[:-1].cuda()  # each sample's first entry is not its own
    keep = torch.ones_like(lp, dtype=torch.bool).index_fill_(0, starts, False)
    torch.testing.assert_close(lp2[keep], lp[keep], atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(ent2[keep], ent[keep], atol=5e-2, rtol=5e-2)
    for (name, a), b in zip(stock.named_parameters(), model.parameters()):
        cos = torch.nn.functional.cosine_similarity(a.grad.float().flatten(), b.grad.float().flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


def test_the_micro_batch_loop_never_makes_the_host_wait():
    from pipelinerl import messages as m
    from pipelinerl_preprocessor.packing import StepSample, pack_wave
    from pipelinerl_trainer.loss import LossConfig
    from pipelinerl_trainer.model import use_policy_forward
    from pipelinerl_trainer.packed_attention import use_packed_attention
    from pipelinerl_trainer.step import StepConfig, StepTally, micro_batch_loss

    model = small_model().cuda().bfloat16().train()
    use_packed_attention(model)
    use_policy_forward(model)
    items = [
        StepSample(
            m.Sample(
                tokens=list(range(2, 2 + n)),
                mask=[0] * 8 + [1] * (n - 8),
                logprobs=[0.0] * 8 + [-1.0] * (n - 8),
                versions=[-1] * 8 + [i % 3] * (n - 8),
                reward=float(i % 2),
            ),
            advantage=0.5 - i % 2,
        )
        for i, n in enumerate(LENGTHS * 3)
        if n > 8
    ]
    batches = pack_wave(0, items, 1, 4096, 1 / len(items), last=True)[0]
    cfg = StepConfig(LossConfig("reinforce", importance="sequence"), 0.7, max_lag=1)
    micro_batch_loss(model, batches[0], 2, cfg, StepTally(1, CUDA)).backward()  # warm-up: caches, kernels
    torch.cuda.synchronize()
    tally = StepTally(1, CUDA)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mb in batches:
            micro_batch_loss(model, mb, 2, cfg, tally).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    metrics = tally.finish().metrics()
    assert metrics["tokens"] > 0 and metrics["samples"] == len(items) and metrics["dropped_for_lag"] > 0
