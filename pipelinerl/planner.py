"""Cluster planner: predict pipeline vs sync throughput, lag and idle time before renting GPUs.

A discrete-event simulation of generators (continuous batching, in-flight weight updates) and
trainers, driven by per-token costs taken from measurements (a calibration file). Pure: no I/O
beyond loading a calibration. The cost model and its assumptions are in docs/planner.md.

    decode step of a generator with B running sequences   decode_base_s + decode_per_seq_s * B
    prefill of a prompt group (prefix cache shares it)     prefill_s_per_token * prompt_tokens
    train step of T tokens on n trainer devices            T * train_s_per_token / (n * train_scaling^log2 n)
                                                           + optimizer_step_s; in pipeline mode the tokens
                                                           are computed in waves as their groups finish
    weight update                                          trainer busy weight_sync_s, generators pause pause_s
    zero-variance filtering                                a share filtered_fraction of the groups is generated,
                                                           then dropped: it frees its admission slot on finishing
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipelinerl.spec import PipelineRLJob, format_errors

CALIBRATIONS = Path(__file__).with_name("calibrations")
# The CPU benchmark records measured costs here; `cpu-tiny` prefers them to the placeholder.
MEASURED_CPU = Path(__file__).resolve().parents[1] / "bench" / "results" / "calibration-cpu.json"
LAGS = (1, 2, 4, 8, 16)
# Recommend the smallest max lag whose throughput is within this fraction of the best one:
# fresher data is worth a little throughput.
LAG_TOLERANCE = 0.03


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
            mu = math.log(self.mean_tokens) - self.sigma**2 / 2  # so that E[x] = mean_tokens
            x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(x), 1, max_tokens).astype(np.int64)


class Calibration(BaseModel):
    """Per-device costs of one hardware/model combination (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    source: str = Field(default="", description="where the numbers come from: measured, estimated")
    gpus_per_engine: int = Field(default=1, ge=1, description="devices per generator engine (tensor parallel)")
    decode_base_s: float = Field(gt=0)
    decode_per_seq_s: float = Field(ge=0)
    max_batch: int = Field(ge=1, description="running sequences per engine (vLLM max_num_seqs / KV cache)")
    prefill_s_per_token: float = Field(default=0.0, ge=0)
    train_s_per_token: float = Field(gt=0, description="fwd+bwd per trained token on one trainer device")
    train_scaling: float = Field(default=1.0, gt=0, le=1, description="throughput kept per doubling of trainers")
    optimizer_step_s: float = Field(default=0.0, ge=0)
    weight_sync_s: float = Field(default=0.0, ge=0)
    pause_s: float = Field(default=0.0, ge=0)
    contention: float = Field(default=0.0, ge=0, description="slow-down of each role while the other computes")
    filtered_fraction: float = Field(
        default=0.0, ge=0, lt=1, description="share of generated groups dropped by zero-variance filtering (all "
                                             "attempts rewarded alike): a property of the task and model, like lengths")
    lengths: Lengths

    def step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch

    def train_s(self, tokens: float, n_train: int) -> float:
        return tokens * self.train_s_per_token / (n_train * self.train_scaling ** math.log2(n_train))


def parse_calibration(data: object, source: str = "calibration") -> Calibration:
    if not isinstance(data, dict):
        raise CalibrationError(f"{source}: expected a mapping of calibration fields, got {type(data).__name__}")
    try:
        return Calibration.model_validate(data)
    except ValidationError as err:
        raise CalibrationError(f"{source} is not a valid calibration:\n{format_errors(err)}") from None


def load_calibration(name_or_path: str | Path) -> Calibration:
    """A calibration file (YAML or JSON), or a built-in name (`h100-7b`, `cpu-tiny`)."""
    path = Path(name_or_path)
    if not path.is_file():
        builtin = CALIBRATIONS / f"{name_or_path}.yaml"
        if str(name_or_path) == "cpu-tiny" and MEASURED_CPU.is_file():
            builtin = MEASURED_CPU
        if not builtin.is_file():
            known = ", ".join(sorted(p.stem for p in CALIBRATIONS.glob("*.yaml")))
            raise CalibrationError(f"{name_or_path}: no such calibration file or built-in (built-ins: {known})")
        path = builtin
    try:
        data = yaml.safe_load(path.read_text())  # JSON is YAML
    except (OSError, yaml.YAMLError) as err:
        raise CalibrationError(f"{path}: cannot read calibration: {err}") from None
    return parse_calibration(data, str(path))


def dump_calibration(calib: Calibration) -> str:
    return yaml.safe_dump(calib.model_dump(mode="json"), sort_keys=False)


@dataclass(frozen=True)
class SimResult:
    mode: str
    generators: int  # devices
    trainers: int  # devices
    max_lag: int
    samples_per_s: float
    step_s: float
    lag_mean: float  # per trained token: trainer version - version that generated it
    lag_p95: float
    lag_max: int
    dropped: float  # fraction of tokens older than max_lag (the trainer zero-weights them)
    gen_busy: float  # fraction of time an engine is decoding (any batch)
    gen_fill: float  # mean running sequences / max_batch: low in sync mode's long tail
    train_busy: float  # fraction of time the trainer computes or sends weights
    samples_trained: int  # in the simulated (synced) steps
    samples_in_flight: int  # on engines, finished but not consumed, or in the step being trained
    samples_started: int
    samples_filtered: int = 0  # generated, then dropped by zero-variance filtering

    @property
    def useful_samples_per_s(self) -> float:
        """What plans are ranked by: throughput less the stale tokens the trainer drops."""
        return self.samples_per_s * (1 - self.dropped)


class _Engine:
    __slots__ = ("running", "waiting", "steps", "t_ref", "free_at", "token", "busy", "fill")

    def __init__(self) -> None:
        self.running: list[tuple[float, int]] = []  # heap of (decode step it finishes at, group)
        self.waiting: deque[tuple[int, int]] = deque()  # (length, group) beyond max_batch
        self.steps = 0.0  # decode steps done: every running sequence gains one token per step
        self.t_ref = 0.0  # wall time `steps` refers to
        self.free_at = 0.0  # paused (weight update) or prefilling until then
        self.token = 0  # invalidates this engine's scheduled event
        self.busy = 0.0  # time spent decoding
        self.fill = 0.0  # integral of running sequences over time

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


class _Sim:
    """One simulated run; `simulate` is the public entry point.

    Events: an engine's next sequence finish, the end of the trainer's compute of an early wave
    of a step ("wave") or of its last wave and optimizer step ("trained"), and the end of its
    weight broadcast ("synced"). Between events every engine decodes at a constant rate,
    so an engine's progress is banked (`_advance`) before anything that changes its rate.
    """

    def __init__(self, mode: str, n_gen: int, n_train: int, max_lag: int, samples_per_step: int,
                 attempts: int, calib: Calibration, max_tokens: int, lengths: Lengths, steps: int,
                 warmup: int, seed: int, filtered: float, wave_groups: int) -> None:
        self.c, self.attempts, self.max_tokens, self.lengths = calib, attempts, max_tokens, lengths
        self.filtered = filtered
        self.mode, self.n_gen, self.n_train = mode, n_gen, n_train
        # Sync mode is max_lag 0: one step of groups admitted, consumed only after the update.
        self.max_lag = max_lag if mode == "pipeline" else 0
        self.groups_per_step = samples_per_step // attempts
        # Pipeline mode streams a step to the trainer in waves of this many groups (0: whole
        # steps, as sync mode); a wave leaves once one more group is pending (packing.next_wave).
        self.wave_groups = wave_groups if mode == "pipeline" else 0
        # Pipeline: as the generator's Admission, one more step of groups once the weights of
        # the step in training are in and until the next step starts (true before the first).
        self.ahead = True
        self.steps, self.warmup = steps, warmup
        self.rng = np.random.default_rng(seed)
        self.pool: list[int] = []
        self.engines = [_Engine() for _ in range(n_gen // calib.gpus_per_engine)]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0  # tie-breaker: equal-time events run in the order they were scheduled
        self.now = 0.0
        # Per group: engine, weights version at its start, lengths, start decode step per sequence.
        self.g_engine: list[int] = []
        self.g_version: list[int] = []
        self.g_lengths: list[list[int]] = []
        self.g_starts: list[list[float]] = []
        self.g_left: list[int] = []
        self.g_drop: list[bool] = []  # zero-variance: dropped when it finishes, never trained
        self.n_dropped = 0
        self.queued = 0  # groups started and not yet consumed by the trainer (nor dropped)
        self.finished: deque[int] = deque()
        self.step_gids: list[int] = []  # groups of the step being trained, taken so far
        self.trained = 0  # groups in finished steps
        self.version = 0  # optimizer steps applied
        self.pauses: list[np.ndarray] = []  # pauses[k-1][engine]: decode step where version k begins
        self.base, self.per_seq = calib.decode_base_s, calib.decode_per_seq_s
        self.slow = 1.0  # decode slow-down while the trainer computes (contention)
        self.computing = self.syncing = False
        self.done = 0  # steps trained and synced
        self.step_end: list[float] = []
        self.train_busy = 0.0
        self.lag_tokens = np.zeros(self.max_lag + 1)  # trained tokens by lag, measured steps only
        self.dropped = 0.0
        self.snap = (0.0, 0.0)

    # -- engines --------------------------------------------------------------------------
    def _step_s(self, e: _Engine) -> float:
        return (self.base + self.per_seq * len(e.running)) * self.slow

    def _advance(self, e: _Engine) -> None:
        start = e.t_ref if e.t_ref > e.free_at else e.free_at
        if self.now > start and e.running:
            dt = self.now - start
            e.steps += dt / self._step_s(e)
            e.busy += dt
            e.fill += dt * len(e.running)
        e.t_ref = self.now

    def _schedule(self, i: int) -> None:
        e = self.engines[i]
        e.token += 1
        if e.running:
            left = e.running[0][0] - e.steps
            start = self.now if self.now > e.free_at else e.free_at
            self._push(start + (left if left > 0 else 0.0) * self._step_s(e), "gen", i, e.token)

    def _push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _length(self) -> int:
        if not self.pool:
            self.pool = self.lengths.sample(self.rng, 4096, self.max_tokens).tolist()
        return self.pool.pop()

    def _start_group(self, i: int) -> None:
        e = self.engines[i]
        self._advance(e)
        # Prefill stalls the engine once per group: the attempts share the prompt (prefix cache).
        e.free_at = max(e.free_at, self.now) + self.c.prefill_s_per_token * self.lengths.prompt_tokens
        gid = len(self.g_engine)
        lengths = [self._length() for _ in range(self.attempts)]
        self.g_engine.append(i)
        self.g_version.append(self.version)
        self.g_lengths.append(lengths)
        self.g_starts.append([])
        self.g_left.append(self.attempts)
        # Drawn only when filtering is on, so a run without it keeps the same random stream.
        self.g_drop.append(self.filtered > 0 and self.rng.random() < self.filtered)
        self.queued += 1
        for n in lengths:
            e.waiting.append((n, gid))
        self._fill(e)
        self._schedule(i)

    def _fill(self, e: _Engine) -> None:
        # A group's sequences start in list order, so g_starts lines up with g_lengths.
        while e.waiting and len(e.running) < self.c.max_batch:
            n, gid = e.waiting.popleft()
            heapq.heappush(e.running, (e.steps + n, gid))
            self.g_starts[gid].append(e.steps)

    @property
    def budget(self) -> int:
        return (max(self.max_lag, 1) + int(bool(self.max_lag) and self.ahead)) * self.groups_per_step

    def _admit(self, prefer: int | None = None) -> None:
        """Start groups while the lag budget allows and an engine has a free slot.

        After a finish only that engine gained room (`prefer`); after the trainer consumed
        groups, every engine may take some: least loaded first.
        """
        if prefer is not None:
            while self.queued < self.budget and self.engines[prefer].load < self.c.max_batch:
                self._start_group(prefer)
            return
        loads = [(e.load, i) for i, e in enumerate(self.engines)]
        heapq.heapify(loads)
        while self.queued < self.budget and loads[0][0] < self.c.max_batch:
            _, i = loads[0]
            self._start_group(i)
            heapq.heapreplace(loads, (self.engines[i].load, i))

    def _set_slow(self, slow: float) -> None:
        # Changes every engine's decode rate (contention): bank progress at the old rate first.
        for e in self.engines:
            self._advance(e)
        self.slow = slow
        for i in range(len(self.engines)):
            self._schedule(i)

    def _on_engine(self, i: int, token: int) -> None:
        e = self.engines[i]
        if token != e.token:
            return
        self._advance(e)
        while e.running and e.running[0][0] <= e.steps + 1e-6:
            _, gid = heapq.heappop(e.running)
            self.g_left[gid] -= 1
            if not self.g_left[gid]:
                if self.g_drop[gid]:
                    # As the generator's admission (on_finish with discarded): the slot frees at
                    # once, so the engine starts a replacement in both modes.
                    self.queued -= 1
                    self.n_dropped += 1
                else:
                    self.finished.append(gid)
        if e.waiting:
            self._fill(e)
        if self.queued < self.budget:
            self._admit(prefer=i)
        self._schedule(i)
        self._train()

    # -- trainer --------------------------------------------------------------------------
    def _train(self) -> None:
        if self.computing or self.syncing:
            return
        need = self.groups_per_step - len(self.step_gids)
        last = len(self.finished) >= need
        if not last and not (self.wave_groups and len(self.finished) > self.wave_groups):
            return
        gids = [self.finished.popleft() for _ in range(need if last else self.wave_groups)]
        self.step_gids += gids
        measured = self.done >= self.warmup
        if measured:
            self._record_lag(gids)
        if last and self.max_lag:
            # Pipeline: consumed once the step is complete, so generation of the next groups
            # overlaps the rest of its training.
            self.queued -= self.groups_per_step
            self.ahead = False
            self._admit()
        tokens = sum(sum(self.g_lengths[g]) for g in gids) + len(gids) * self.attempts * self.lengths.prompt_tokens
        overlap = any(e.running for e in self.engines)
        seconds = self.c.train_s(tokens, self.n_train) * (1 + self.c.contention * overlap)
        seconds += self.c.optimizer_step_s if last else 0.0
        self.computing = True
        if self.c.contention:
            self._set_slow(1.0 + self.c.contention)
        if measured:
            self.train_busy += seconds + (self.c.weight_sync_s if last else 0.0)
        self._push(self.now + seconds, "trained" if last else "wave", self.groups_per_step)

    def _on_wave(self) -> None:
        self.computing = False
        if self.c.contention:
            self._set_slow(1.0)
        self._train()

    def _on_trained(self, consumed: int) -> None:
        self.computing, self.syncing = False, True
        for e in self.engines:
            self._advance(e)
            e.free_at = max(e.free_at, self.now) + self.c.pause_s
        self.version += 1
        # Tokens decoded after this pause carry the new version.
        self.pauses.append(np.array([e.steps for e in self.engines]))
        self._set_slow(1.0)  # the trainer stopped computing; reschedules every engine
        self._push(self.now + self.c.weight_sync_s, "synced", consumed)

    def _on_synced(self, consumed: int) -> None:
        self.syncing = False
        self.trained += consumed
        self.step_gids = []
        self.done += 1
        self.step_end.append(self.now)
        if self.done == self.warmup:
            self.snap = self._engine_totals()
        if not self.max_lag:
            self.queued -= consumed  # sync: the next step's groups start on the new weights
        self.ahead = True
        self._admit()
        self._train()

    def _record_lag(self, gids: list[int]) -> None:
        """Split each sequence's tokens by version: decode steps before/after each pause."""
        eng = np.repeat([self.g_engine[g] for g in gids], self.attempts)
        start = np.concatenate([self.g_starts[g] for g in gids])
        length = np.concatenate([self.g_lengths[g] for g in gids]).astype(float)
        v0 = min(self.g_version[g] for g in gids)
        at_least = [float(length.sum())]  # at_least[j]: tokens with version >= v0 + j
        for k in range(v0 + 1, self.version + 1):
            at_least.append(float(np.clip(start + length - self.pauses[k - 1][eng], 0, length).sum()))
        at_least.append(0.0)
        for j in range(len(at_least) - 1):
            lag = self.version - (v0 + j)
            tokens = at_least[j] - at_least[j + 1]
            if lag > self.max_lag:
                self.dropped += tokens  # the trainer zero-weights tokens older than max_lag
            else:
                self.lag_tokens[lag] += tokens

    def _engine_totals(self) -> tuple[float, float]:
        for e in self.engines:
            self._advance(e)
        return sum(e.busy for e in self.engines), sum(e.fill for e in self.engines)

    def run(self) -> SimResult:
        self._admit()
        while self.done < self.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at step {self.done}: no group can finish (a bug)")
            self.now, _, kind, a, b = heapq.heappop(self.events)
            if kind == "gen":
                self._on_engine(a, b)
            elif kind == "wave":
                self._on_wave()
            elif kind == "trained":
                self._on_trained(a)
            else:
                self._on_synced(a)
        busy, fill = (x - y for x, y in zip(self._engine_totals(), self.snap))
        window = self.step_end[-1] - (self.step_end[self.warmup - 1] if self.warmup else 0.0)
        measured = self.steps - self.warmup
        n_eng = len(self.engines)
        lags = self.lag_tokens
        trained = max(lags.sum(), 1e-12)
        return SimResult(
            mode=self.mode, generators=self.n_gen, trainers=self.n_train, max_lag=self.max_lag,
            samples_per_s=measured * self.groups_per_step * self.attempts / window,
            step_s=window / measured,
            lag_mean=float(lags @ np.arange(len(lags)) / trained),
            lag_p95=float(np.searchsorted(np.cumsum(lags) / trained, 0.95 - 1e-9)),
            lag_max=int(np.flatnonzero(lags > 1e-9).max(initial=0)),
            dropped=float(self.dropped / (trained + self.dropped)),
            gen_busy=min(busy / (n_eng * window), 1.0),
            gen_fill=min(fill / (n_eng * window * self.c.max_batch), 1.0),
            train_busy=min(self.train_busy / window, 1.0),
            samples_trained=self.trained * self.attempts,
            samples_in_flight=(sum(1 for n in self.g_left if n) + len(self.finished) + len(self.step_gids)) * self.attempts,
            samples_started=len(self.g_engine) * self.attempts,
            samples_filtered=self.n_dropped * self.attempts,
        )


def simulate(mode: Literal["pipeline", "sync"], n_gen: int, n_train: int, max_lag: int, samples_per_step: int,
             attempts: int, calib: Calibration, max_tokens: int, lengths: Lengths | None = None,
             steps: int | None = None, warmup: int | None = None, seed: int = 0,
             filtered: float | None = None, wave_groups: int = 0) -> SimResult:
    """Simulate `steps` optimizer steps; rates and lag are measured after the first `warmup`.

    n_gen / n_train are devices; sync mode ignores max_lag (it is 0 there by definition).
    `filtered`: share of groups dropped by zero-variance filtering (default: the calibration's).
    `wave_groups`: groups per early wave of a streamed step in pipeline mode (`wave_groups`
    below; 0: the trainer waits for whole steps).
    Default warm-up max_lag + 2 steps: a trainer-bound pipeline's lag climbs one step per step
    until it reaches max_lag. Default steps: warm-up + 7. Deterministic for a given seed.
    """
    if mode not in ("pipeline", "sync"):
        raise ValueError(f"mode must be 'pipeline' or 'sync', got {mode!r}")
    warmup = (max_lag if mode == "pipeline" else 0) + 2 if warmup is None else warmup
    steps = warmup + 7 if steps is None else steps
    if samples_per_step % attempts:
        raise ValueError(f"samples_per_step ({samples_per_step}) must be a multiple of attempts ({attempts})")
    if n_gen < calib.gpus_per_engine or n_train < 1:
        raise ValueError(f"need at least one generator engine ({calib.gpus_per_engine} devices) and one trainer, "
                         f"got {n_gen} and {n_train}")
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be in [0, steps={steps})")
    filtered = calib.filtered_fraction if filtered is None else filtered
    if not 0 <= filtered < 1:
        raise ValueError(f"filtered ({filtered}) must be in [0, 1)")
    return _Sim(mode, n_gen, n_train, max_lag, samples_per_step, attempts, calib, max_tokens,
                lengths or calib.lengths, steps, warmup, seed, filtered, wave_groups).run()


def wave_groups(job: PipelineRLJob, trainer_ranks: int, lengths: Lengths) -> int:
    """Groups in each early wave of a step streamed in pipeline mode (0: not streamed), as
    `packing.next_wave` forms them from groups of mean length: as many as one row per trainer
    rank is sure to hold."""
    spec = job.spec
    if spec.rl.token_weighting != "sample":
        return 0
    max_tokens = spec.generator.sampling.max_tokens
    completion = float(np.mean(lengths.sample(np.random.default_rng(0), 4096, max_tokens)))
    group = spec.rl.attempts * (lengths.prompt_tokens + completion)
    longest = lengths.prompt_tokens + max_tokens
    return max(1, int(trainer_ranks * (spec.trainer.micro_batch_tokens - longest) // group))


@dataclass(frozen=True)
class Plan:
    job: str
    model: str
    gpus: int
    calibration: str
    samples_per_step: int
    attempts: int
    max_tokens: int
    pipeline: SimResult  # best pipeline split, smallest max lag within LAG_TOLERANCE of the best
    sync: SimResult  # best split in sync mode
    colocated: SimResult  # every device generates, then every device trains (the paper's baseline)
    lag_sweep: tuple[SimResult, ...]  # pipeline at its best split, one per max lag in LAGS
    filtered: float = 0.0  # share of generated groups dropped by zero-variance filtering

    @property
    def recommended(self) -> SimResult:
        # Colocation is not something this project runs: it is a reference point only.
        return self.pipeline if self.speedup >= 1 else self.sync

    @property
    def speedup(self) -> float:
        return self.pipeline.useful_samples_per_s / self.sync.useful_samples_per_s

    @property
    def speedup_vs_colocated(self) -> float:
        return self.pipeline.useful_samples_per_s / self.colocated.useful_samples_per_s


def splits(gpus: int, trainer_granularity: int, gpus_per_engine: int) -> list[int]:
    """Trainer device counts to try: whole trainer pods, the rest whole generator engines."""
    return [t for t in range(trainer_granularity, gpus, trainer_granularity)
            if (gpus - t) >= gpus_per_engine and (gpus - t) % gpus_per_engine == 0]


def _best(grid: list[int], run: Callable[[int], SimResult]) -> SimResult:
    """Maximise useful samples/s over the splits by golden-section search: throughput is
    unimodal in the split (too few trainers starve on training, too few generators on
    generation), and each probe is reused by the next, so 128 choices cost ~10 simulations."""
    cache: dict[int, SimResult] = {}

    def f(i: int) -> float:
        if i not in cache:
            cache[i] = run(grid[i])
        return cache[i].useful_samples_per_s

    lo, hi = 0, len(grid) - 1
    while hi - lo > 3:
        d = round((hi - lo) * 0.382)
        a, b = lo + d, hi - d
        if f(a) < f(b):
            lo = a
        else:
            hi = b
    return cache[max(range(lo, hi + 1), key=lambda i: (f(i), -i))]


def plan(job: PipelineRLJob, gpus: int, calib: Calibration, lengths: Lengths | None = None, seed: int = 0) -> Plan:
    """Best pipeline config (split, then the smallest max lag within LAG_TOLERANCE of the best
    throughput) and best sync split, for `gpus` devices."""
    spec = job.spec
    grid = splits(gpus, max(spec.trainer.gpus, 1), calib.gpus_per_engine)
    if not grid:
        raise ValueError(f"--gpus {gpus} leaves no split: need at least one trainer pod "
                         f"({max(spec.trainer.gpus, 1)} devices) and one generator engine ({calib.gpus_per_engine})")
    filtered = calib.filtered_fraction if spec.rl.filter_zero_variance else 0.0
    common = dict(samples_per_step=spec.trainer.samples_per_step, attempts=spec.rl.attempts, calib=calib,
                  max_tokens=spec.generator.sampling.max_tokens, lengths=lengths, seed=seed, filtered=filtered)

    # The split at the largest lag (least constrained); throughput settles within a few steps,
    # so the search skips the long warm-up that lag statistics need. Then the lag at that split.
    def waves(t: int) -> int:
        return wave_groups(job, t, lengths or calib.lengths)

    best = _best(grid, lambda t: simulate("pipeline", gpus - t, t, LAGS[-1], steps=10, warmup=3,
                                          wave_groups=waves(t), **common))
    sweep = tuple(simulate("pipeline", best.generators, best.trainers, lag, wave_groups=waves(best.trainers), **common)
                  for lag in LAGS)
    top = max(r.useful_samples_per_s for r in sweep)
    chosen = next(r for r in sweep if r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * top)
    sync = _best(grid, lambda t: simulate("sync", gpus - t, t, 0, **common))
    colocated = simulate("sync", gpus, gpus, 0, **common)
    return Plan(job=job.name, model=spec.model.path, gpus=gpus, calibration=calib.name,
                samples_per_step=spec.trainer.samples_per_step, attempts=spec.rl.attempts,
                max_tokens=spec.generator.sampling.max_tokens, pipeline=chosen, sync=sync,
                colocated=colocated, lag_sweep=sweep, filtered=filtered)


def format_plan(p: Plan) -> str:
    head = ("", "mode", "generators", "trainers", "max lag", "samples/s", "step s", "lag mean", "lag p95",
            "dropped %", "gen idle %", "batch fill %", "train idle %")
    rows = []
    for label, r in [("pipeline", r) for r in p.lag_sweep] + [("sync", p.sync), ("sync colocated", p.colocated)]:
        rows.append(("*" if r is p.recommended else "", label, str(r.generators), str(r.trainers), str(r.max_lag),
                     f"{r.samples_per_s:.3g}", f"{r.step_s:.3g}", f"{r.lag_mean:.2f}", f"{r.lag_p95:.0f}",
                     f"{100 * r.dropped:.1f}", f"{100 * (1 - r.gen_busy):.0f}", f"{100 * r.gen_fill:.0f}",
                     f"{100 * (1 - r.train_busy):.0f}"))
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    filtered = f", {100 * p.filtered:.0f}% of groups filtered as zero-variance" if p.filtered else ""
    lines = [f"{p.job}: {p.model}, {p.samples_per_step} samples/step ({p.attempts} attempts{filtered}), "
             f"maxTokens {p.max_tokens}, {p.gpus} devices, calibration {p.calibration}", ""]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *rows)]
    r = p.recommended
    lines += ["", f"recommendation: mode {r.mode}, {r.generators} generator + {r.trainers} trainer devices, "
              f"maxLag {r.max_lag}: {r.samples_per_s:.3g} samples/s",
              f"pipeline vs sync: {p.speedup:.2f}x (best split each); vs colocated sync "
              f"(the paper's baseline): {p.speedup_vs_colocated:.2f}x"]
    return "\n".join(lines)
