"""RL policy losses (pure tensor functions) and the per-token log-probabilities they need.

All inputs are 1-D over the tokens of a packed row, already shifted so that position t holds
the log-probability of token t; `weights` is 0 on tokens that are not trained (prompt,
environment replies, samples dropped for lag), so sums over all positions are safe. Nothing
here reads a value back to the host (no `.item()`, no boolean indexing): a GPU runs ahead.
r_t = exp(logπ_θ(a_t) − logμ(a_t)), μ being the sampling policy whose logprobs the engine
returned with each token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The bound on a log-ratio before it is exponentiated (ratio ≤ e^20 ≈ 4.9e8, its square finite in
# fp32). Past ~88.7, exp is inf: PPO's loss is then NaN where A = 0 (inf · 0) and DeepSpeed skips
# the whole step for one token, and the ESS read the inf sums as 1.0. The clipped losses weigh such
# a token no differently below the bound; past it, no gradient flows through the ratio.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossConfig:
    kind: str = "reinforce"  # reinforce | ppo | gspo | cispo
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    # What the weight of reinforce/cispo corrects: each token's own ratio r_t ("token"), or the
    # sample's Π_t r_t ("sequence"), which also corrects how likely the token's prefix was.
    importance: str = "token"


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution: the
    reference arithmetic, over whole logits (the trainer computes the same from hidden states
    without them, `logprob_head.linear_logprobs`).

    logits: [L, V] for a row, tokens: [L]. Returns tensors of length L where entry t (t ≥ 1)
    belongs to token t (predicted from position t−1) and entry 0 is 0. Computed in fp32 on
    temperature-scaled logits, as the engine samples them (train/inference parity).
    """
    logp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens[1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = logits.new_zeros(1, dtype=torch.float32)
    return torch.cat([zero, picked]), torch.cat([zero, entropy])


def sequence_sum(values: torch.Tensor, sample_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per token: the sum of `values` over the masked tokens of its sample (sample ids index a
    buffer as long as the row, which always has room: each sample has a token)."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))
    return values.new_zeros(values.shape[0]).index_add(0, sample_ids, masked)[sample_ids]


def sequence_mean(values: torch.Tensor, sample_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per token: the mean of `values` over the masked tokens of its sample."""
    counts = sequence_sum(torch.ones_like(values), sample_ids, mask).clamp(min=1)
    return sequence_sum(values, sample_ids, mask) / counts


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cfg: LossConfig,
    sample_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Σ_t w_t · ℓ_t for the chosen objective, plus statistics (sums over the trained tokens, as
    0-dim tensors on the inputs' device)."""
    trained = weights > 0
    log_ratio = torch.where(trained, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    hi, lo = 1.0 + cfg.epsilon_high, 1.0 - cfg.epsilon_low
    if cfg.importance not in ("token", "sequence"):
        raise ValueError(f"unknown importance weights {cfg.importance!r} (token, sequence)")
    weight_ratio = ratio  # what reinforce and cispo weight each token by
    if cfg.importance == "sequence" and cfg.kind in ("reinforce", "cispo"):
        if sample_ids is None:
            raise ValueError("sequence importance weights need sample_ids")
        # A sample's reward comes at its end, so the exact off-policy weight of each of its
        # tokens is the whole sample's ratio, not the token's own.
        weight_ratio = sequence_sum(log_ratio, sample_ids, trained).exp()

    if cfg.kind == "reinforce":
        # Truncated importance sampling: the weight is capped and carries no gradient.
        is_weight = weight_ratio.clamp(max=hi).detach()
        per_token = -advantages * new_logprobs * is_weight
        clipped = weight_ratio > hi
    elif cfg.kind == "cispo":
        # sg(clip(r, ·, 1+ε)): bounded above only (MiniMax-M1 sets no lower bound; a floor at
        # 1-ε_low weighed a token the policy moved away from as though it had not moved)
        is_weight = weight_ratio.clamp(max=hi).detach()
        per_token = -advantages * new_logprobs * is_weight
        clipped = weight_ratio > hi
    elif cfg.kind == "ppo":
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)
        clipped = ((ratio > hi) & (advantages > 0)) | ((ratio < lo) & (advantages < 0))
    elif cfg.kind == "gspo":
        if sample_ids is None:
            raise ValueError("gspo needs sample_ids to form sequence-level ratios")
        # GSPO-token form: the value is the sequence ratio exp(mean log r), the gradient flows
        # through each token's own logprob; each token's term is its sample's mean (1/|y_i|), so
        # a sample weighs w_t whatever its length, as in sequence-level GSPO for sequence advantages.
        seq_log_ratio = sequence_mean(log_ratio, sample_ids, trained)
        ratio = (seq_log_ratio.detach() + new_logprobs - new_logprobs.detach()).exp()
        per_token = -torch.minimum(ratio * advantages, ratio.clamp(lo, hi) * advantages)
        # the KL and entropy terms too: their weight against the policy's is the other losses'
        weights = weights / sequence_sum(torch.ones_like(ratio), sample_ids, trained).clamp(min=1)
        clipped = ((ratio > hi) & (advantages > 0)) | ((ratio < lo) & (advantages < 0))
    else:
        raise ValueError(f"unknown loss {cfg.kind!r} (reinforce, ppo, gspo, cispo)")

    loss = (weights * per_token).sum()
    kl = None
    if cfg.kl_coef > 0 and ref_logprobs is not None:
        x = torch.where(trained, ref_logprobs - new_logprobs, torch.zeros_like(new_logprobs)).clamp(max=MAX_LOG_RATIO)
        kl = x.exp() - x - 1  # k3 estimator: unbiased, always ≥ 0 (0 where untrained, never 0 · inf)
        loss = loss + cfg.kl_coef * (weights * kl).sum()
    if cfg.entropy_coef > 0 and entropy is not None:
        loss = loss - cfg.entropy_coef * (weights * entropy).sum()

    with torch.no_grad():

        def trained_sum(values: torch.Tensor) -> torch.Tensor:
            return torch.where(trained, values, torch.zeros_like(values)).sum()

        r = ratio.detach()
        stats = {
            "tokens": trained.sum(),
            "ratio_sum": trained_sum(r),
            "ratio_sq_sum": trained_sum(r * r),
            "clipped": (clipped & trained).sum(),
        }
        if kl is not None:
            stats["kl_sum"] = trained_sum(kl)
        if entropy is not None:
            stats["entropy_sum"] = trained_sum(entropy)
    return loss, stats


def effective_sample_size(ratio_sum: float, ratio_sq_sum: float, n: float) -> float:
    """ESS = (Σ r)² / (N Σ r²) ∈ (0, 1]; 1 when the data is exactly on-policy.

    Clamped at 1: the two sums are rounded separately (float32, over micro-batches), so an
    on-policy batch can come out a hair above the bound Cauchy-Schwarz sets."""
    return min(1.0, ratio_sum**2 / (n * ratio_sq_sum)) if n and ratio_sq_sum else 1.0
