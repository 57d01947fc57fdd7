"""Per-token log-probabilities and entropies straight from the last hidden states, fused with
the LM head and chunked over tokens, so no [tokens, vocabulary] tensor is ever whole.

`token_logprobs` (loss.py) takes logits: for a 151,936-token vocabulary and an 8,192-token row
the logits, their fp32 copy, the log-softmax and the entropy's product are 5 GB each. Here the
head's matmul, the temperature, the log-softmax, the picked token and the entropy are computed
one chunk of tokens at a time, keeping only two numbers per token; the backward pass recomputes
each chunk's logits and turns them into the gradients of the hidden states and of the head's
weight. The arithmetic is `token_logprobs`'s on fp32 logits.

The LM head runs in fp32 (REFERENCE: train/inference parity): its operands are in the compute
dtype (the weights', or autocast's), their products summed and kept in fp32, never rounded to 16
bits (a bf16 logit of 20 is off by up to 0.06, and so is its log-prob). The generator's vLLM
computes its head so too (`head_dtype`, which the generator sets): on CUDA both are one GEMM
writing fp32 (`torch.mm(out_dtype=)`); elsewhere the operands are cast up first, the same numbers.

Two ways to do a chunk's arithmetic after its matmul, equal to rounding (tests):
- eager (the CPU path): in place on the chunk's fp32 logits, `LOGIT_CHUNK_BYTES` of them; a
  dozen passes over them, each its own kernel.
- compiled (CUDA, where Triton is installed): the same formulas under torch.compile, which fuses
  them into a few kernels that read the chunk's logits and write one gradient in the compute
  dtype: no copy of the chunk, so chunks of `COMPILED_CHUNK_BYTES` of logits. On a GPU the
  eager passes cost several times the head's matmuls: on an H200 at Qwen2-0.5B shapes (with the
  logits then in bf16) they were the top kernels of the step, and compiling them took it from
  1.64 to 1.11 s (benchmark 6).

With z = logits / temperature, p = softmax(z), H = -Σ p log p:
  d log p[a] / dz = onehot(a) - p,    dH / dz = -p (log p + H).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

LOGIT_CHUNK_BYTES = 256 << 20  # eager: the fp32 logits of one chunk (two such buffers are alive at once)
COMPILED_CHUNK_BYTES = 512 << 20  # compiled: the fp32 logits of one chunk (and its gradient, in the compute dtype)
FP32_OUT = (torch.bfloat16, torch.float16)  # the operand dtypes a CUDA GEMM sums into fp32 output


def chunk_tokens(vocab: int, budget: int = LOGIT_CHUNK_BYTES) -> int:
    return max(1, budget // (4 * vocab))


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def head_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The head's weight as `head_logits` takes it: in the compute dtype where a GEMM writes fp32
    from it (CUDA, 16-bit); elsewhere cast up to fp32, once a pass (16-bit values are exact in fp32)."""
    w = weight.to(dtype)
    return w if w.is_cuda and dtype in FP32_OUT else w.float()


def head_logits(hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """hidden [n, H] (compute dtype), `head_weight`'s w [V, H] → fp32 logits [n, V]."""
    if w.dtype == torch.float32:
        return hidden.float() @ w.T
    return torch.mm(hidden, w.t(), out_dtype=torch.float32)


def add_weight_grad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """acc (fp32 [V, H]) += grad.T @ h over a chunk, `head_weight`'s operands: summed in fp32 and
    never rounded to 16 bits; on CUDA one GEMM accumulating 16-bit operands into the fp32 sum
    (`torch.addmm(out_dtype=)`, no [V, H] product of its own; an fp32 sum beside 16-bit operands
    is taken since pytorch#167931, Nov 2025: vLLM 0.32's image has torch 2.13)."""
    if grad.dtype == torch.float32:
        acc.addmm_(grad.T, h)
    else:
        torch.addmm(acc, grad.T, h, out_dtype=torch.float32, out=acc)


def compiled_by_default(device: torch.device) -> bool:
    """The compiled chunk arithmetic where it pays and compiles: CUDA with Triton."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


# --- a chunk's arithmetic, as formulas (compiled) ---------------------------------------------


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """fp32 logits [n, V] → fp32 (log-sum-exp, log p(target), entropy) [n] of z."""
    z = logits / temperature
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    return lse, logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def chunk_grad(logits, targets, lse, entropy, g_lp, g_ent, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """dL/dlogits [n, V] in `dtype` (the head weight's), given dL/dlogp(target) and dL/dH per row."""
    logp = logits / temperature - lse[:, None]
    p = logp.exp()
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    grad = ((logp + entropy[:, None]) * -g_ent[:, None] - g_lp[:, None]) * p + torch.where(onehot, g_lp[:, None], 0.0)
    return (grad / temperature).to(dtype)


@functools.cache
def _compiled():
    # dynamic: one compilation for every chunk length (a row's last chunk is shorter)
    return torch.compile(chunk_stats, dynamic=True), torch.compile(chunk_grad, dynamic=True)


# --- the same, eager and in place (one fp32 buffer per chunk) ----------------------------------


def _eager_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    z = _scaled(logits, temperature)
    lse = torch.logsumexp(z, -1)
    z.sub_(lse[:, None])  # log p
    logprobs = z.gather(-1, targets[:, None])[:, 0]
    return lse, logprobs, -z.exp().mul_(z).sum(-1)


def _eager_grad(logits, targets, lse, entropy, g_lp, g_ent, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    logp = _scaled(logits, temperature).sub_(lse[:, None])
    p = logp.exp()
    # dL/dz = g_lp (onehot - p) - g_ent p (log p + H), built in logp's buffer
    grad = logp.add_(entropy[:, None]).mul_(-g_ent[:, None]).sub_(g_lp[:, None]).mul_(p)
    del p
    grad.scatter_add_(1, targets[:, None], g_lp[:, None])
    return grad.div_(temperature).to(dtype)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """In place: the logits are the chunk's own fp32 buffer."""
    return logits.div_(temperature) if temperature != 1.0 else logits


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, dtype: torch.dtype, compiled: bool):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        stats = _compiled()[0] if compiled else _eager_stats
        w = head_weight(weight, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, chunk):
                s = slice(a, min(n, a + chunk))
                lse[s], logprobs[s], entropy[s] = stats(head_logits(hidden[s].to(dtype), w), targets[s], temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype, ctx.compiled = temperature, chunk, dtype, compiled
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        dtype = ctx.dtype
        n = hidden.shape[0]
        w = head_weight(weight, dtype)
        grad_of = _compiled()[1] if ctx.compiled else _eager_grad
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        g_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(lse)
        g_ent = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, ctx.chunk):
                s = slice(a, min(n, a + ctx.chunk))
                h = hidden[s].to(dtype)
                logits = head_logits(h, w)
                grad = grad_of(logits, targets[s], lse[s], entropy[s], g_lp[s], g_ent[s], ctx.temperature, w.dtype)
                del logits
                h = h.to(w.dtype)
                if grad_hidden is not None:
                    grad_hidden[s] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    add_weight_grad(grad_weight, grad, h)
                del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int | None = None,
    compiled: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], the LM head's weight [V, H], targets [N] → (log p(target), entropy), fp32
    [N]: row i's next-token distribution softmax(hidden[i] · weightᵀ / temperature). `compiled`:
    the chunk arithmetic compiled (default: `compiled_by_default`)."""
    compiled = compiled_by_default(hidden.device) if compiled is None else compiled
    dtype = _compute_dtype(weight)
    if chunk is None:
        chunk = chunk_tokens(weight.shape[0], COMPILED_CHUNK_BYTES if compiled else LOGIT_CHUNK_BYTES)
    return _LinearLogprobs.apply(hidden, weight, targets, float(temperature), chunk, dtype, compiled)
