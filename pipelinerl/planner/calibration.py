"""Planner calibrations: the per-device costs of one hardware/model combination.

A calibration is a YAML or JSON file of `Calibration` fields; the built-ins are package data,
`pipelinerl/calibrations/<name>.yaml`. The costs enter the simulation as follows (docs/planner.md):

    decode step of a generator with B running sequences   decode_base_s + Σ over them (decode_per_seq_s
    of contexts c_1..c_B (prompt + tokens so far)           + decode_per_token_s * c_i), B at most the
                                                           engine's batch (`engine_batch`)
    prefill of a prompt group (prefix cache shares it)     prefill_s_per_token * prompt_tokens
      and each of its requests' own cost                   + attempts * request_s (the engine stalls)
    train step of T tokens on n trainer devices            T * train_s_per_token / (n * train_scaling^log2 n)
                                                           + optimizer_step_s; in pipeline mode the tokens
                                                           are computed in waves as their groups finish
    weight update                                          trainer busy weight_sync_s, generators pause pause_s
    zero-variance filtering                                a share filtered_fraction of the groups is generated,
                                                           then dropped: it frees its admission slot on finishing
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipelinerl.spec import parse_mapping

# The built-in calibrations: package data of pipelinerl.calibrations.
CALIBRATIONS = Path(__file__).resolve().parents[1] / "calibrations"


class CalibrationError(ValueError):
    """A calibration file that does not validate; the message names every field at fault."""


class Lengths(BaseModel):
    """Completion lengths (clipped at the job's maxTokens) and prompt length."""

    model_config = ConfigDict(extra="forbid")
    distribution: Literal["lognormal", "empirical"] = "lognormal"
    mean_tokens: float | None = Field(default=None, gt=0, description="lognormal: mean before clipping")
    sigma: float = Field(default=0.0, ge=0, le=4, description="lognormal shape; 0: every completion alike")
    values: list[int] = Field(default_factory=list, description="empirical: measured completion lengths")
    prompt_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _complete(self) -> Lengths:
        if self.distribution == "lognormal" and self.mean_tokens is None:
            raise ValueError("mean_tokens is required for a lognormal distribution")
        if self.distribution == "empirical" and (not self.values or min(self.values) < 1):
            raise ValueError("values must be a non-empty list of lengths >= 1 for an empirical distribution")
        return self

    def sample(self, rng: np.random.Generator, n: int, max_tokens: int) -> np.ndarray:
        if self.distribution == "empirical":
            x = rng.choice(np.asarray(self.values, dtype=float), size=n)
        else:
            assert self.mean_tokens, "a log-normal length distribution needs its mean"
            mu = math.log(self.mean_tokens) - self.sigma**2 / 2  # so that E[x] = mean_tokens
            x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(x), 1, max_tokens).astype(np.int64)

    def mean(self, max_tokens: int) -> float:
        """The mean completion at this cap, from a fixed sample (the same for every caller)."""
        return float(np.mean(self.sample(np.random.default_rng(0), 4096, max_tokens)))


class TensorParallel(BaseModel):
    """How an engine's costs change with its devices, for the planner's range over tensor
    parallelism (`at_tensor_parallel`): the weights streamed each decode step, the per-sequence
    GEMMs, the KV cache read and the prefill split over the devices; a step's fixed overhead
    (scheduling, launches) does not; at TP > 1 each step adds its all-reduces. The KV cache an
    engine holds grows with its devices' memory less their share of the weights."""

    model_config = ConfigDict(extra="forbid")
    weights_bytes: float = Field(gt=0, description="the model's weights as the engine holds them")
    kv_bytes_per_token: float = Field(gt=0, description="KV cache per token of context, all layers")
    fixed_s: float = Field(default=0.0, ge=0, description="the part of decode_base_s that TP does not split")
    allreduce_s: float = Field(ge=0, description="a decode step's all-reduces at TP > 1 (two per layer)")


class Calibration(BaseModel):
    """Per-device costs of one hardware/model combination (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    source: str = Field(default="", description="where the numbers come from: measured, estimated")
    gpus_per_engine: int = Field(default=1, ge=1, description="devices per generator engine (tensor parallel)")
    decode_base_s: float = Field(gt=0)
    decode_per_seq_s: float = Field(ge=0)
    decode_per_token_s: float = Field(
        default=0.0,
        ge=0,
        description="per running sequence and token of its context (prompt + generated so far): the KV "
        "cache it reads every step, so a step slows as its sequences grow",
    )
    max_batch: int = Field(ge=1, description="running sequences per engine (vLLM max_num_seqs)")
    kv_cache_tokens: int | None = Field(
        default=None,
        ge=1,
        description="KV cache of one engine, in tokens: it holds at most this / (prompt + mean completion) "
        "sequences (None: max_batch alone bounds the batch)",
    )
    prefill_s_per_token: float = Field(default=0.0, ge=0)
    request_s: float = Field(
        default=0.0,
        ge=0,
        description="what each request costs its engine outside the decode steps (admission, output handling, "
        "the serving API's work; where the rest of the rollout path shares the engines' cores, as on a CPU "
        "machine, its work per request too): short completions pay more of it per token",
    )
    train_s_per_token: float = Field(gt=0, description="fwd+bwd per trained token on one trainer device")
    train_scaling: float = Field(default=1.0, gt=0, le=1, description="throughput kept per doubling of trainers")
    optimizer_step_s: float = Field(default=0.0, ge=0)
    weight_sync_s: float = Field(default=0.0, ge=0)
    pause_s: float = Field(default=0.0, ge=0)
    contention: float = Field(default=0.0, ge=0, description="slow-down of each role while the other computes")
    filtered_fraction: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="share of generated groups dropped by zero-variance filtering (all "
        "attempts rewarded alike): a property of the task and model, like lengths",
    )
    tensor_parallel: TensorParallel | None = Field(
        default=None, description="how the costs scale with gpus_per_engine (None: the planner does not vary TP)"
    )
    lengths: Lengths

    def step_s(self, batch: int, context: float = 0.0) -> float:
        """A decode step's time with `batch` sequences of `context` tokens each."""
        return self.decode_base_s + batch * (self.decode_per_seq_s + self.decode_per_token_s * context)

    def engine_batch(self, lengths: Lengths, max_tokens: int, max_running: int | None = None) -> int:
        """Sequences one engine runs at once: max_batch, the generator's cap on running
        sequences (`max_running`: the reference implementation's llm_max_rollouts), and what
        the KV cache holds at the mean context a sequence reaches (vLLM would preempt beyond:
        not modelled)."""
        cap = min(self.max_batch, max_running or self.max_batch)
        if self.kv_cache_tokens:
            cap = min(cap, max(1, int(self.kv_cache_tokens // (lengths.prompt_tokens + lengths.mean(max_tokens)))))
        return cap

    def train_s(self, tokens: float, n_train: int) -> float:
        return tokens * self.train_s_per_token / (n_train * self.train_scaling ** math.log2(n_train))


def at_tensor_parallel(calib: Calibration, tp: int) -> Calibration:
    """`calib`'s costs for engines of `tp` devices, from how they scale (`calib.tensor_parallel`;
    pure). Raises ValueError where they cannot: no scaling given, or weights that do not fit."""
    x = calib.tensor_parallel
    if x is None:
        raise ValueError(f"calibration {calib.name}: no tensor_parallel scaling to vary TP by")
    t0 = calib.gpus_per_engine
    if tp == t0:
        return calib

    def allreduce(t: int) -> float:
        return x.allreduce_s if t > 1 else 0.0

    streamed = calib.decode_base_s - x.fixed_s - allreduce(t0)  # the weights' stream: split
    if streamed <= 0:
        raise ValueError(f"calibration {calib.name}: tensor_parallel's fixed_s and allreduce_s exceed decode_base_s")
    share = t0 / tp
    kv = None
    if calib.kv_cache_tokens:
        usable = (calib.kv_cache_tokens * x.kv_bytes_per_token + x.weights_bytes) / t0  # per device
        kv = int((tp * usable - x.weights_bytes) / x.kv_bytes_per_token)
        if kv < 1:
            raise ValueError(f"calibration {calib.name}: the weights leave no KV cache on {tp} device(s)")
    return calib.model_copy(
        update={
            "name": f"{calib.name} at TP {tp}",
            "gpus_per_engine": tp,
            "decode_base_s": x.fixed_s + streamed * share + allreduce(tp),
            "decode_per_seq_s": calib.decode_per_seq_s * share,
            "decode_per_token_s": calib.decode_per_token_s * share,
            "prefill_s_per_token": calib.prefill_s_per_token * share,
            "kv_cache_tokens": kv,
        }
    )


def parse_calibration(data: object, source: str = "calibration") -> Calibration:
    return parse_mapping(Calibration, data, source, "calibration", CalibrationError)


def load_calibration(name_or_path: str | Path) -> Calibration:
    """A calibration file (YAML or JSON), or the name of a built-in (`h100-7b`, `cpu-tiny`)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = CALIBRATIONS / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in CALIBRATIONS.glob("*.yaml")))
            raise CalibrationError(f"{name_or_path}: no such calibration file or built-in (built-ins: {known})")
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as err:
        raise CalibrationError(f"{path}: cannot read calibration: {err}") from None
    return parse_calibration(data, str(path))
