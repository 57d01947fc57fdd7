"""Per-token log-probabilities and entropies straight from the last hidden states, fused with
the LM head and chunked over tokens, so no [tokens, vocabulary] tensor is ever whole.

`token_logprobs` (loss.py) takes logits: for a 151,936-token vocabulary and an 8,192-token row
the logits, their fp32 copy, the log-softmax and the entropy's product are 5 GB each. Here the
head's matmul, the temperature, the log-softmax, the picked token and the entropy are computed
one chunk of tokens at a time, keeping only two numbers per token; the backward pass recomputes
each chunk's logits and turns them into the gradients of the hidden states and of the head's
weight. The arithmetic is `token_logprobs`'s: the matmul in the compute dtype (the weights', or
autocast's), the rest in fp32.

Two ways to do a chunk's arithmetic after its matmul, equal to rounding (tests):
- eager (the CPU path): in place on one fp32 copy of the chunk's logits, `LOGIT_CHUNK_BYTES` of
  them; a dozen passes over it, each its own kernel.
- compiled (CUDA, where Triton is installed): the same formulas under torch.compile, which fuses
  them into a few kernels that read the chunk's logits in the compute dtype and write one
  gradient in it: no fp32 copy, so chunks of `COMPILED_CHUNK_BYTES` of logits. On a GPU the
  eager passes cost several times the head's matmuls: on an H200 at Qwen2-0.5B shapes they were
  the top kernels of the step, and compiling them took it from 1.64 to 1.11 s (benchmark 6).

With z = logits / temperature, p = softmax(z), H = -Σ p log p:
  d log p[a] / dz = onehot(a) - p,    dH / dz = -p (log p + H).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

LOGIT_CHUNK_BYTES = 256 << 20  # eager: fp32 logits of one chunk (two such buffers are alive at once)
COMPILED_CHUNK_BYTES = 512 << 20  # compiled: logits of one chunk in the compute dtype (and its gradient)


def chunk_tokens(vocab: int, budget: int = LOGIT_CHUNK_BYTES, itemsize: int = 4) -> int:
    return max(1, budget // (itemsize * vocab))


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


def compiled_by_default(device: torch.device) -> bool:
    """The compiled chunk arithmetic where it pays and compiles: CUDA with Triton."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


# --- a chunk's arithmetic, as formulas (compiled) ---------------------------------------------


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Logits [n, V] (compute dtype) → fp32 (log-sum-exp, log p(target), entropy) [n] of z."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    return lse, logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def chunk_grad(logits, targets, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    """dL/dlogits [n, V] in the logits' dtype, given dL/dlogp(target) and dL/dH per row."""
    logp = logits.float() / temperature - lse[:, None]
    p = logp.exp()
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    grad = ((logp + entropy[:, None]) * -g_ent[:, None] - g_lp[:, None]) * p + torch.where(onehot, g_lp[:, None], 0.0)
    return (grad / temperature).to(logits.dtype)


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


def _eager_grad(logits, targets, lse, entropy, g_lp, g_ent, temperature: float) -> torch.Tensor:
    logp = _scaled(logits, temperature).sub_(lse[:, None])
    p = logp.exp()
    # dL/dz = g_lp (onehot - p) - g_ent p (log p + H), built in logp's buffer
    grad = logp.add_(entropy[:, None]).mul_(-g_ent[:, None]).sub_(g_lp[:, None]).mul_(p)
    del p
    grad.scatter_add_(1, targets[:, None], g_lp[:, None])
    return grad.div_(temperature).to(logits.dtype)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z.div_(temperature) if temperature != 1.0 else z


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, dtype: torch.dtype, compiled: bool):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        stats = _compiled()[0] if compiled else _eager_stats
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, chunk):
                s = slice(a, min(n, a + chunk))
                lse[s], logprobs[s], entropy[s] = stats(hidden[s].to(dtype) @ w.T, targets[s], temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype, ctx.compiled = temperature, chunk, dtype, compiled
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        dtype = ctx.dtype
        n = hidden.shape[0]
        w = weight.to(dtype)
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
                grad = grad_of(h @ w.T, targets[s], lse[s], entropy[s], g_lp[s], g_ent[s], ctx.temperature)
                if grad_hidden is not None:
                    grad_hidden[s] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:  # accumulated in fp32 over the chunks
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad.T, h)
                    else:
                        grad_weight.add_(grad.T @ h)
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
        budget, itemsize = (COMPILED_CHUNK_BYTES, dtype.itemsize) if compiled else (LOGIT_CHUNK_BYTES, 4)
        chunk = chunk_tokens(weight.shape[0], budget, itemsize)
    return _LinearLogprobs.apply(hidden, weight, targets, float(temperature), chunk, dtype, compiled)
