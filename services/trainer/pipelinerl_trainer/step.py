"""One optimizer step's arithmetic, shared by the trainer service and the trainer benchmark:
the loss of a packed micro-batch and the step metrics reduced from per-micro-batch sums.

`model` is anything called like a Hugging Face causal LM (a DeepSpeed engine or the bare model).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipelinerl import messages as m
from pipelinerl_trainer.loss import LossConfig, effective_sample_size, policy_loss, token_logprobs

SUMS = ("loss", "tokens", "ratio_sum", "ratio_sq_sum", "clipped", "entropy_sum", "kl_sum", "samples", "reward_sum",
        "dropped", "row_tokens", "rejected")


@dataclass
class StepConfig:
    loss: LossConfig
    temperature: float
    max_lag: int


@dataclass
class StepTally:
    """Sums over a step's micro-batches (reduced over ranks before `metrics`) and token lags."""
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(len(SUMS), dtype=torch.float64))
    lags: list[int] = field(default_factory=list)

    def reject(self, samples: int) -> None:
        """Samples the model cannot take (dead-lettered, blanked)."""
        self.sums[SUMS.index("rejected")] += samples

    def metrics(self) -> dict:
        s = dict(zip(SUMS, self.sums.tolist()))
        tokens, n = s["tokens"], s["samples"]
        lag = torch.tensor(self.lags or [0], dtype=torch.float64)
        return {"loss": s["loss"], "reward": s["reward_sum"] / max(n, 1), "samples": int(n), "tokens": int(tokens),
                "row_tokens": int(s["row_tokens"]),  # prompts included: what the forward pass computes
                "ess": effective_sample_size(s["ratio_sum"], s["ratio_sq_sum"], tokens),
                "ratio_mean": s["ratio_sum"] / max(tokens, 1), "clip_fraction": s["clipped"] / max(tokens, 1),
                "entropy": s["entropy_sum"] / max(tokens, 1), "kl": s["kl_sum"] / max(tokens, 1),
                "lag_min": float(lag.min()), "lag_mean": float(lag.mean()), "lag_max": float(lag.max()),

                "dropped_for_lag": int(s["dropped"]), "samples_rejected": int(s["rejected"]),
                # Token counts per lag, flat keys (metric values are scalars): tokens_lag_0, tokens_lag_1, …
                **{f"tokens_lag_{int(k)}": int(c) for k, c in zip(*torch.unique(lag.long(), return_counts=True))}}


def micro_batch_loss(model, mb: m.MicroBatch, version: int, cfg: StepConfig, tally: StepTally,
                     ref_model=None) -> torch.Tensor:
    """The loss of one micro-batch trained at policy `version`; statistics go into `tally`."""
    dev = getattr(model, "device", None)  # a DeepSpeed engine's or Hugging Face model's; None: the default
    if mb.is_sentinel:
        # Same forward/backward shape on every rank, zero contribution.
        return model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=dev)).logits.sum() * 0.0
    ids, positions = torch.tensor([mb.tokens], device=dev), torch.tensor([mb.positions], device=dev)
    # use_cache=False matters: with a cache transformers ignores the packing in position ids
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    new_lp, entropy = token_logprobs(logits, ids[0], cfg.temperature)
    versions, weights = torch.tensor(mb.versions, device=dev), torch.tensor(mb.weights, device=dev)
    trained = weights > 0
    # Drop what is older than the lag budget (counted per sample).
    too_old = trained & (version - versions > cfg.max_lag)
    sample_ids = torch.tensor(mb.sample_ids, device=dev)
    dropped = int(torch.unique(sample_ids[too_old]).numel())
    weights = torch.where(too_old, torch.zeros_like(weights), weights)
    tally.lags += (version - versions[trained & ~too_old]).tolist()  # lags of what is trained
    ref_lp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logits = ref_model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            ref_lp, _ = token_logprobs(ref_logits, ids[0], cfg.temperature)
    loss, st = policy_loss(new_lp, torch.tensor(mb.logprobs, device=dev), torch.tensor(mb.advantages, device=dev),
                           weights, cfg.loss,
                           sample_ids=sample_ids, ref_logprobs=ref_lp, entropy=entropy)
    tally.sums += torch.tensor([loss.item(), st["tokens"], st["ratio_sum"], st["ratio_sq_sum"], st["clipped"],
                                st.get("entropy_sum", 0.0), st.get("kl_sum", 0.0), len(mb.rewards),
                                sum(mb.rewards), dropped, len(mb.tokens), 0], dtype=torch.float64)
    return loss


def step_config(job) -> StepConfig:
    rl = job.spec.rl
    return StepConfig(LossConfig(rl.loss, rl.epsilon_low, rl.epsilon_high, rl.kl_coef, rl.entropy_coef,
                                 rl.importance_weights),
                      job.spec.generator.sampling.temperature, job.spec.max_lag)
