"""A micro-batch on the training device: its per-token fields as tensors, moved in two copies
that never make the host wait, and its packing (where each sample's sequence is) built from the
lengths the preprocessor sent."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pipelinerl import messages as m
from pipelinerl_trainer.packed_attention import Packing, to


@dataclass(frozen=True)
class DeviceBatch:
    tokens: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    versions: torch.Tensor  # [T] long: the policy version that sampled each token (-1: not generated)
    sample_ids: torch.Tensor  # [T] long: the packed sample each token belongs to
    logprobs: torch.Tensor  # [T] fp32: the sampler's
    advantages: torch.Tensor  # [T] fp32
    weights: torch.Tensor  # [T] fp32: per-token loss weight, 0 where nothing is trained
    packing: Packing
    samples: int  # host facts, for the step's tallies
    reward_sum: float


def device_batch(mb: m.MicroBatch, device: torch.device | str) -> DeviceBatch:
    """`mb` on `device`. A sentinel (no samples) becomes one untrained token: the same forward
    and backward as a real row, so the ranks' collectives (ZeRO-3's gathers) stay in step."""
    if mb.is_sentinel:
        mb = m.MicroBatch(
            step=mb.step,
            rank=mb.rank,
            index=mb.index,
            tokens=[0],
            positions=[0],
            mask=[0],
            advantages=[0.0],
            logprobs=[0.0],
            versions=[-1],
            weights=[0.0],
            lengths=[1],
            rewards=[0.0],
        )
        return dataclasses.replace(device_batch(mb, device), samples=0)
    sample_ids = torch.repeat_interleave(torch.arange(len(mb.lengths)), torch.tensor(mb.lengths))
    tokens, positions, versions, sample_ids = to(
        torch.cat([torch.tensor([mb.tokens, mb.positions, mb.versions], dtype=torch.long), sample_ids[None]]), device
    )
    logprobs, advantages, weights = to(
        torch.tensor([mb.logprobs, mb.advantages, mb.weights], dtype=torch.float32), device
    )
    return DeviceBatch(
        tokens,
        positions,
        versions,
        sample_ids,
        logprobs,
        advantages,
        weights,
        packing=Packing.of(mb.lengths, device),
        samples=len(mb.rewards),
        reward_sum=float(sum(mb.rewards)),
    )
