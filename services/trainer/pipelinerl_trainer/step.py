"""One optimizer step's arithmetic, shared by the trainer service and the trainer benchmarks:
the loss of a packed micro-batch, and the step's metrics from tallies that stay on the device
until the step ends (read once per step, not per micro-batch: a GPU is never made to wait).

`model` is anything called like the trainer's model (`model.use_policy_forward`): a DeepSpeed
engine or the bare model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelinerl import messages as m
from pipelinerl.steps import token_lag, too_old
from pipelinerl_trainer.batch import DeviceBatch, device_batch
from pipelinerl_trainer.loss import LossConfig, effective_sample_size, policy_loss

SUMS = (
    "loss",
    "tokens",
    "ratio_sum",
    "ratio_sq_sum",
    "clipped",
    "entropy_sum",
    "kl_sum",
    "samples",
    "reward_sum",
    "dropped",
    "row_tokens",
    "rejected",
)
DEVICE_SUMS = SUMS[:7] + ("dropped",)  # computed on the device; the rest are host facts of the messages


@dataclass
class StepConfig:
    loss: LossConfig
    temperature: float
    max_lag: int


class StepTally:
    """Sums over a step's micro-batches and a histogram of the trained tokens' lags (0..max_lag).
    The device's part accumulates on the device; `finish` reads it once (and sums over ranks)."""

    def __init__(self, max_lag: int, device: torch.device | str = "cpu"):
        self.max_lag = max_lag
        self.device_sums = torch.zeros(len(DEVICE_SUMS) + max_lag + 1, dtype=torch.float64, device=device)
        self.host = dict.fromkeys(SUMS, 0.0)
        self.totals: list[float] | None = None

    def add(self, **values: float) -> None:
        """Host facts (samples, rewards, row tokens, rejected samples)."""
        for k, v in values.items():
            self.host[k] += v

    def add_device(self, values: torch.Tensor, lags: torch.Tensor) -> None:
        """`values` in DEVICE_SUMS order; `lags` the histogram's counts, on the device."""
        self.device_sums[: len(DEVICE_SUMS)] += values
        self.device_sums[len(DEVICE_SUMS) :] += lags

    def finish(self, world: int = 1) -> StepTally:
        """Read the step's sums: one copy from the device (an all-reduce over `world` ranks first)."""
        host = torch.tensor([self.host[k] for k in SUMS], dtype=torch.float64, device=self.device_sums.device)
        dev = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device_sums.device)
        dev[[SUMS.index(k) for k in DEVICE_SUMS]] = self.device_sums[: len(DEVICE_SUMS)]
        both = torch.cat([host + dev, self.device_sums[len(DEVICE_SUMS) :]])
        if world > 1:
            dist.all_reduce(both)
        self.totals = both.tolist()
        return self

    def metrics(self) -> dict:
        totals = self.totals if self.totals is not None else self.finish().totals
        assert totals is not None  # finish() sets them
        s = dict(zip(SUMS, totals))
        hist = totals[len(SUMS) :]
        tokens, n = s["tokens"], s["samples"] - s["rejected"]  # rejected samples are packed, not trained
        counted = [(lag, int(c)) for lag, c in enumerate(hist) if c]
        lag_tokens = sum(c for _, c in counted)
        return {
            "loss": s["loss"],
            "reward_trained": s["reward_sum"] / max(n, 1),
            "samples": int(n),
            "tokens": int(tokens),
            "row_tokens": int(s["row_tokens"]),  # prompts included: what the forward pass computes
            "ess": effective_sample_size(s["ratio_sum"], s["ratio_sq_sum"], tokens),
            "ratio_mean": s["ratio_sum"] / max(tokens, 1),
            "clip_fraction": s["clipped"] / max(tokens, 1),
            "entropy": s["entropy_sum"] / max(tokens, 1),
            "kl": s["kl_sum"] / max(tokens, 1),
            "lag_min": float(counted[0][0]) if counted else 0.0,
            "lag_mean": sum(lag * c for lag, c in counted) / lag_tokens if counted else 0.0,
            "lag_max": float(counted[-1][0]) if counted else 0.0,
            "dropped_for_lag": int(s["dropped"]),
            "samples_rejected": int(s["rejected"]),
            # Token counts per lag, flat keys (metric values are scalars): tokens_lag_0, tokens_lag_1, …
            **{f"tokens_lag_{lag}": c for lag, c in counted},
        }


def micro_batch_loss(
    model, mb: m.MicroBatch, version: int, cfg: StepConfig, tally: StepTally, ref_model=None
) -> torch.Tensor:
    """The loss of one micro-batch trained at policy `version`; statistics go into `tally`."""
    dev = getattr(model, "device", None) or torch.device("cpu")  # a DeepSpeed engine's or HF model's
    tally.add(row_tokens=len(mb.tokens))
    b = device_batch(mb, dev)  # a sentinel: one untrained token (the ranks' passes stay alike)
    tally.add(samples=b.samples, reward_sum=b.reward_sum)
    new_lp, entropy = policy_logprobs(model, b, cfg.temperature)
    trained = b.weights > 0
    # Drop what is older than the lag budget (counted per sample).
    lag = token_lag(version, b.versions)
    dropped = trained & too_old(lag, cfg.max_lag)
    stale_samples = torch.zeros_like(b.weights).index_add_(0, b.sample_ids, dropped.float())
    weights = torch.where(dropped, torch.zeros_like(b.weights), b.weights)
    kept = (trained & ~dropped).double()
    lags = torch.zeros(cfg.max_lag + 1, dtype=torch.float64, device=dev).index_add_(
        0, lag.clamp(0, cfg.max_lag), kept
    )  # lags of what is trained
    ref_lp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_lp, _ = policy_logprobs(ref_model, b, cfg.temperature)
    loss, st = policy_loss(
        new_lp,
        b.logprobs,
        b.advantages,
        weights,
        cfg.loss,
        sample_ids=b.sample_ids,
        ref_logprobs=ref_lp,
        entropy=entropy,
    )
    zero = loss.new_zeros(())
    values = torch.stack(
        [v.double() for v in (loss.detach(), *(st.get(k, zero) for k in DEVICE_SUMS[1:-1]), (stale_samples > 0).sum())]
    )
    tally.add_device(values, lags)
    return loss


def backward(engine, loss: torch.Tensor, world: int) -> None:
    """A micro-batch's backward on one of `world` data-parallel ranks. DeepSpeed averages the
    gradients over the ranks, while the loss weights already sum over them (a sample weighs
    1/samplesPerStep on whichever rank it lands): scaled back, the ranks' step is one rank's."""
    engine.backward(loss * world)


def policy_logprobs(model, b: DeviceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log-prob, entropy) of the batch's row under `model`."""
    return model(input_ids=b.tokens[None], position_ids=b.positions[None], packing=b.packing, temperature=temperature)


class ComputeClock:
    """Seconds spent computing, waits for data excluded (`with clock:` around each piece of
    work). On a GPU the host runs ahead of the device, so the spans are CUDA events on the
    stream, read once the step's work is done (`seconds`)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self.host_s = 0.0
        self.spans: list = []

    def __enter__(self) -> None:
        if self.cuda:
            self.spans.append([torch.cuda.Event(enable_timing=True)])
            self.spans[-1][0].record()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.spans[-1].append(torch.cuda.Event(enable_timing=True))
            self.spans[-1][1].record()
        else:
            self.host_s += time.perf_counter() - self.t0

    def seconds(self) -> float:
        if self.cuda:
            self.spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans) / 1000
        return self.host_s


def step_config(job) -> StepConfig:
    rl = job.spec.rl
    return StepConfig(
        LossConfig(rl.loss, rl.epsilon_low, rl.epsilon_high, rl.kl_coef, rl.entropy_coef, rl.importance_weights),
        job.spec.generator.sampling.temperature,
        job.spec.max_lag,
    )
