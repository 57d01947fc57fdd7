"""The planner simulation's parameters (`SimParams`: one object, checked, its dependent defaults
filled in; `wave_groups`, the one a job implies), its result (`SimResult`) and its measuring
window; the simulation itself (its state and event loop): `pipelinerl.planner.simulation`. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipelinerl.planner.calibration import Calibration, Lengths
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import wave_capacity

# The measuring window (when `steps` is not given). A pipeline starts empty: its rate and lag
# settle only once the start-up's groups have all finished (the longest of them live the longest
# sequence's lifetime) and, when the trainer is the bottleneck, once its lag has climbed until
# admission holds it (the queue fills the lag budget), or for CLIMB_LIFETIMES of the longest
# lifetime seen (a slow climb: the rate has settled, the lag has not, `lag_settled`). Then a long
# tail makes the rate vary over a lifetime, so the window lasts at least WINDOW_LIFETIMES of the
# longest group lifetime seen (admission to finish) and MIN_STEPS steps. A sync phase starts
# from empty engines every time, so it needs no warm-up; its window is whole phases, at least
# MIN_STEPS steps.
WINDOW_LIFETIMES = 3.0
CLIMB_LIFETIMES = 2.0
MIN_STEPS = 7
MAX_STEPS = 1_000_000  # a guard: no simulation of a plan comes near it


@dataclass(frozen=True)
class SimResult:
    mode: str  # "pipeline", or "sync" (conventional with steps_per_generation steps per phase)
    generators: int  # devices
    trainers: int  # devices (colocated: the same devices as the generators)
    max_lag: int  # the admission's max lag (pipeline); 0 in sync mode
    samples_per_s: float
    step_s: float
    lag_mean: float  # per trained token: trainer version - version that generated it
    lag_p95: float
    lag_max: int
    dropped: float  # fraction of tokens older than max_lag (the trainer zero-weights them)
    gen_busy: float  # fraction of time an engine is decoding (any batch)
    gen_fill: float  # mean running sequences / the engine's batch: low in a sync phase's long tail
    train_busy: float  # fraction of time the trainer computes or sends weights
    samples_trained: int  # in the simulated (synced) steps
    samples_in_flight: int  # on engines, finished but not consumed, or in the step being trained
    samples_started: int
    samples_filtered: int = 0  # generated, then dropped by zero-variance filtering
    steps_per_generation: int = 1  # k: optimizer steps per generation phase (sync mode)
    colocated: bool = False  # generators and trainers share every device, phase by phase
    window_s: float = 0.0  # the measuring window (simulated seconds)
    longest_s: float = 0.0  # the longest lifetime of a group seen (admission to finish)
    engine_batch: int = 0  # running sequences an engine holds at most
    gen_tokens_per_busy_s: float = 0.0  # tokens an engine decodes per second of decoding
    # ... and per second it holds a group (prefills, request costs and pauses too): what a run's
    # generator_busy_fraction counts
    gen_tokens_per_held_s: float = 0.0
    lag_settled: bool = True  # False: a trainer-bound pipeline's lag was still climbing (the window's lag is low)

    @property
    def useful_samples_per_s(self) -> float:
        """What plans are ranked by: throughput less the stale tokens the trainer drops."""
        return self.samples_per_s * (1 - self.dropped)

    @property
    def label(self) -> str:
        """The mode as a baseline is named: `pipeline`, or `conventional k=4, split`."""
        if self.mode == "pipeline":
            return "pipeline"
        return f"conventional k={self.steps_per_generation}, {'colocated' if self.colocated else 'split'}"


@dataclass
class SimParams:
    """One simulated run's parameters (`simulate` takes them as they are listed here).

    n_gen / n_train are devices; sync mode ignores max_lag (it is 0 there by definition).
    `steps_per_generation` (sync mode): k optimizer steps per generation phase. `colocated`
    (sync mode): the generators and the trainers are the same devices, taking turns: pass
    n_gen = n_train = every device. `filtered`: share of groups dropped by zero-variance
    filtering (default: the calibration's). `wave_groups`: groups per early wave of a
    streamed step in pipeline mode (`wave_groups` below; 0: the trainer waits for whole
    steps). `max_inflight`: groups an engine may run at once (the generator's
    `maxInflightGroups`; None: as many as its batch holds). `max_running`: sequences an engine
    may run at once (the reference implementation's `llm_max_rollouts`; None: the
    calibration's batch). `logprob_pass` (sync mode): the share of a step's training cost a
    baseline adds to recompute the old policy's log-probs in a forward pass of its own (verl;
    TRL with steps_per_generation > 1): about 1/3 (a forward of a forward and backward), 1/4
    with activation recomputation; 0 for this project's trainer, which takes the engines'
    log-probs, as the reference implementation does. `trace`, when given, receives what
    admission hears, in the generators' terms (test_admission replays it).

    Without `steps`, the window adapts (CLIMB_LIFETIMES, WINDOW_LIFETIMES, MIN_STEPS above):
    the warm-up and the window are sized by the longest sequence's lifetime (`window_lifetimes`
    and `climb_lifetimes` shorten them for a search's probes, whose rates need only rank). With
    `steps` (and `warmup`, default max_lag + 2 in pipeline mode, 0 in sync mode) they are
    fixed; in sync mode both are whole phases.
    """

    mode: Literal["pipeline", "sync"]
    n_gen: int
    n_train: int
    max_lag: int
    samples_per_step: int
    attempts: int
    calib: Calibration
    max_tokens: int
    lengths: Lengths | None = None  # None: the calibration's
    steps: int | None = None
    warmup: int | None = None
    seed: int = 0
    filtered: float | None = None  # None: the calibration's
    wave_groups: int = 0
    max_inflight: int | None = None
    trace: list[tuple] | None = None
    steps_per_generation: int = 1
    colocated: bool = False
    max_running: int | None = None
    logprob_pass: float = 0.0
    window_lifetimes: float = WINDOW_LIFETIMES
    climb_lifetimes: float = CLIMB_LIFETIMES

    def __post_init__(self) -> None:
        """Checked, and the defaults that depend on others filled in (ValueError naming the one at fault)."""
        mode, n_gen, n_train, max_lag, calib = self.mode, self.n_gen, self.n_train, self.max_lag, self.calib
        samples_per_step, attempts, k = self.samples_per_step, self.attempts, self.steps_per_generation
        colocated, max_running, steps, warmup = self.colocated, self.max_running, self.steps, self.warmup
        if mode not in ("pipeline", "sync"):
            raise ValueError(f"mode must be 'pipeline' or 'sync', got {mode!r}")
        if k < 1 or (mode == "pipeline" and k != 1):
            raise ValueError(f"steps_per_generation ({k}) must be >= 1, and 1 in pipeline mode")
        if colocated and (mode == "pipeline" or n_gen != n_train):
            raise ValueError("colocated runs are sync mode on shared devices: n_gen must equal n_train")
        if samples_per_step % attempts:
            raise ValueError(f"samples_per_step ({samples_per_step}) must be a multiple of attempts ({attempts})")
        if n_gen < calib.gpus_per_engine or n_train < 1:
            raise ValueError(
                f"need at least one generator engine ({calib.gpus_per_engine} devices) and one trainer, "
                f"got {n_gen} and {n_train}"
            )
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running ({max_running}) must be >= 1")
        if max_lag < 0:
            raise ValueError(f"max_lag ({max_lag}) must be >= 0")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight ({self.max_inflight}) must be >= 1 (None: no cap)")
        if n_gen % calib.gpus_per_engine and not colocated:  # colocated: the devices left over only train
            raise ValueError(f"n_gen ({n_gen}) must be whole engines of {calib.gpus_per_engine} devices ({calib.name})")
        if steps is not None:
            warmup = (max_lag + 2 if mode == "pipeline" and max_lag else 0) if warmup is None else warmup
            if not 0 <= warmup < steps:
                raise ValueError(f"warmup ({warmup}) must be in [0, steps={steps})")
            if warmup % k or steps % k:
                raise ValueError(f"steps ({steps}) and warmup ({warmup}) must be whole phases of {k}")
        elif warmup is not None and warmup < 0:
            raise ValueError(f"warmup ({warmup}) must be >= 0")
        self.warmup = warmup
        self.lengths = self.lengths or calib.lengths
        if self.logprob_pass < 0 or (mode == "pipeline" and self.logprob_pass):
            raise ValueError(
                f"logprob_pass ({self.logprob_pass}) must be >= 0, and 0 in pipeline mode (its trainer takes "
                "the engines' log-probs)"
            )
        self.filtered = calib.filtered_fraction if self.filtered is None else self.filtered
        if not 0 <= self.filtered < 1:
            raise ValueError(f"filtered ({self.filtered}) must be in [0, 1)")


def wave_groups(job: PipelineRLJob, trainer_ranks: int, lengths: Lengths) -> int:
    """Groups in each early wave of a step streamed in pipeline mode (0: not streamed), as
    `steps.next_wave` forms them from groups of mean length: as many as one row per trainer
    rank is sure to hold."""
    spec = job.spec
    if spec.rl.token_weighting != "sample":
        return 0
    max_tokens = spec.generator.sampling.max_tokens
    group = spec.rl.attempts * (lengths.prompt_tokens + lengths.mean(max_tokens))
    longest = lengths.prompt_tokens + max_tokens
    return max(1, int(wave_capacity(trainer_ranks, spec.trainer.micro_batch_tokens, longest) // group))
