"""Per-token log-probabilities and entropies straight from the last hidden states, fused with
the LM head and chunked over tokens, so no [tokens, vocabulary] tensor is ever whole.

`token_logprobs` (loss.py) takes logits: for a 151,936-token vocabulary and an 8,192-token row
the logits, their fp32 copy, the log-softmax and the entropy's product are 5 GB each. Here the
head's matmul, the temperature, the log-softmax, the picked token and the entropy are computed
one chunk of tokens at a time (`LOGIT_CHUNK_BYTES` of fp32 logits per chunk), keeping only two
numbers per token; the backward pass recomputes each chunk's logits and turns them into the
gradients of the hidden states and of the head's weight. The arithmetic is `token_logprobs`'s:
the matmul in the compute dtype (the weights', or autocast's), the rest in fp32.

With z = logits / temperature, p = softmax(z), H = -Σ p log p:
  d log p[a] / dz = onehot(a) - p,    dH / dz = -p (log p + H).
"""

from __future__ import annotations

import torch

LOGIT_CHUNK_BYTES = 256 << 20  # fp32 logits of one chunk (two such buffers are alive at once)


def chunk_tokens(vocab: int, budget: int = LOGIT_CHUNK_BYTES) -> int:
    return max(1, budget // (4 * vocab))


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    kind = weight.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, dtype: torch.dtype):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, chunk):
                b = min(n, a + chunk)
                z = _scaled_logits(hidden[a:b].to(dtype), w, temperature)
                lse[a:b] = torch.logsumexp(z, -1)
                z.sub_(lse[a:b, None])  # log p
                logprobs[a:b] = z.gather(-1, targets[a:b, None])[:, 0]
                entropy[a:b] = -z.exp().mul_(z).sum(-1)
                del z  # before the next chunk's is made
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        t, dtype = ctx.temperature, ctx.dtype
        n = hidden.shape[0]
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        g_lp = grad_logprobs if grad_logprobs is not None else torch.zeros_like(lse)
        g_ent = grad_entropy if grad_entropy is not None else torch.zeros_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            for a in range(0, n, ctx.chunk):
                b = min(n, a + ctx.chunk)
                h = hidden[a:b].to(dtype)
                logp = _scaled_logits(h, w, t).sub_(lse[a:b, None])
                p = logp.exp()
                # dL/dz = g_lp (onehot - p) - g_ent p (log p + H), built in logp's buffer
                grad = logp.add_(entropy[a:b, None]).mul_(-g_ent[a:b, None]).sub_(g_lp[a:b, None]).mul_(p)
                del p
                grad.scatter_add_(1, targets[a:b, None], g_lp[a:b, None])
                grad = grad.div_(t).to(dtype)  # dL/dlogits
                if grad_hidden is not None:
                    grad_hidden[a:b] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:  # accumulated in fp32 over the chunks
                    if dtype == torch.float32:
                        grad_weight.addmm_(grad.T, h)
                    else:
                        grad_weight.add_(grad.T @ h)
                del grad, logp
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _scaled_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (h @ w.T).float()
    return z.div_(temperature) if temperature != 1.0 else z


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], the LM head's weight [V, H], targets [N] → (log p(target), entropy), fp32
    [N]: row i's next-token distribution softmax(hidden[i] · weightᵀ / temperature)."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    return _LinearLogprobs.apply(hidden, weight, targets, float(temperature), chunk, _compute_dtype(weight))
