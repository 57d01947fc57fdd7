"""Planner simulation: a discrete-event simulation of one run, pipeline or sync mode.

Generators (continuous batching, in-flight weight updates) and trainers, driven by the
per-token costs of a calibration (`pipelinerl.planner.calibration`). Pure and deterministic
for a seed. The rules it simulates are imported, not restated: the generators' admission
(`pipelinerl.admission.lag_budget`) and the preprocessor's waves
(`pipelinerl.steps.wave_capacity`).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pipelinerl.admission import lag_budget
from pipelinerl.planner.calibration import Calibration, Lengths
from pipelinerl.spec import PipelineRLJob
from pipelinerl.steps import wave_capacity


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
    __slots__ = ("running", "waiting", "steps", "t_ref", "free_at", "token", "busy", "fill", "groups")

    def __init__(self) -> None:
        self.running: list[tuple[float, int]] = []  # heap of (decode step it finishes at, group)
        self.waiting: deque[tuple[int, int]] = deque()  # (length, group) beyond max_batch
        self.steps = 0.0  # decode steps done: every running sequence gains one token per step
        self.t_ref = 0.0  # wall time `steps` refers to
        self.free_at = 0.0  # paused (weight update) or prefilling until then
        self.token = 0  # invalidates this engine's scheduled event
        self.busy = 0.0  # time spent decoding
        self.fill = 0.0  # integral of running sequences over time
        self.groups = 0  # started, not finished (the generator's max_inflight_groups caps it)

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

    def __init__(
        self,
        mode: str,
        n_gen: int,
        n_train: int,
        max_lag: int,
        samples_per_step: int,
        attempts: int,
        calib: Calibration,
        max_tokens: int,
        lengths: Lengths,
        steps: int,
        warmup: int,
        seed: int,
        filtered: float,
        wave_groups: int,
        max_inflight: int | None,
        trace: list[tuple] | None = None,
    ) -> None:
        self.c, self.attempts, self.max_tokens, self.lengths = calib, attempts, max_tokens, lengths
        self.filtered = filtered
        self.max_inflight = max_inflight or 1 << 30
        self.mode, self.n_gen, self.n_train = mode, n_gen, n_train
        # Sync mode is max_lag 0: one step of groups admitted, consumed only after the update.
        self.max_lag = max_lag if mode == "pipeline" else 0
        self.groups_per_step = samples_per_step // attempts
        # Pipeline mode streams a step to the trainer in waves of this many groups (0: whole
        # steps, as sync mode); a wave leaves once one more group is pending (steps.next_wave).
        self.wave_groups = wave_groups if mode == "pipeline" else 0
        # The step last started, as the generators' Admission hears it from the trainer (none yet).
        self.training_step = -1
        # What admission hears, as the generators' Admission calls, each with the budget and the
        # queue after it (simulate's `trace`).
        self.trace = trace
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
        # Groups still generating, by the version they started at (few versions, many groups:
        # the budget reads the oldest at every event).
        self.running: Counter[int] = Counter()
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

    def _heard(self, event: str, *args: int | bool) -> None:
        if self.trace is not None:
            self.trace.append((event, *args, self.budget, self.queued))

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
        self.running[self.version] += 1
        self.g_lengths.append(lengths)
        self.g_starts.append([])
        self.g_left.append(self.attempts)
        # Drawn only when filtering is on, so a run without it keeps the same random stream.
        self.g_drop.append(self.filtered > 0 and self.rng.random() < self.filtered)
        self.queued += 1
        self._heard("start", self.version)
        e.groups += 1
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
        # The generator's admission rule (Admission.budget) for the whole cluster, whose share
        # of a step is all of it: counted from the oldest group still generating.
        return lag_budget(
            self.max_lag, self.groups_per_step, min(self.running, default=self.version), self.training_step
        )

    def _room(self, e: _Engine) -> bool:
        return e.load < self.c.max_batch and e.groups < self.max_inflight

    def _admit(self, prefer: int | None = None) -> None:
        """Start groups while the lag budget allows and an engine has room (a free batch slot,
        fewer than `max_inflight` groups running).

        After a finish only that engine gained room (`prefer`); after the trainer consumed
        groups, every engine may take some: least loaded first.
        """
        if prefer is not None:
            while self.queued < self.budget and self._room(self.engines[prefer]):
                self._start_group(prefer)
            return
        loads = [(e.load, i) for i, e in enumerate(self.engines) if self._room(e)]
        heapq.heapify(loads)
        while self.queued < self.budget and loads:
            _, i = loads[0]
            self._start_group(i)
            if self._room(self.engines[i]):
                heapq.heapreplace(loads, (self.engines[i].load, i))
            else:
                heapq.heappop(loads)

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
        raised = False  # the oldest group still generating finished: every engine may gain budget
        while e.running and e.running[0][0] <= e.steps + 1e-6:
            _, gid = heapq.heappop(e.running)
            self.g_left[gid] -= 1
            if not self.g_left[gid]:
                e.groups -= 1
                v = self.g_version[gid]
                self.running[v] -= 1
                if not self.running[v]:
                    del self.running[v]
                    raised |= v < min(self.running, default=self.version)  # it was the oldest
                if self.g_drop[gid]:
                    # As the generator's admission (on_finish with discarded): the slot frees at
                    # once, so the engine starts a replacement in both modes.
                    self.queued -= 1
                    self.n_dropped += 1
                else:
                    self.finished.append(gid)
                self._heard("finish", v, self.g_drop[gid])
        if e.waiting:
            self._fill(e)
        if self.queued < self.budget:
            self._admit(prefer=i)
            if raised:
                self._admit()
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
            self.training_step = self.done
            self._heard("trained", self.trained + self.groups_per_step, self.training_step)
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
        self._heard("weights", self.version)
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
            self._heard("trained", self.trained, self.done - 1)
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
            mode=self.mode,
            generators=self.n_gen,
            trainers=self.n_train,
            max_lag=self.max_lag,
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
            samples_in_flight=(sum(1 for n in self.g_left if n) + len(self.finished) + len(self.step_gids))
            * self.attempts,
            samples_started=len(self.g_engine) * self.attempts,
            samples_filtered=self.n_dropped * self.attempts,
        )


def simulate(
    mode: Literal["pipeline", "sync"],
    n_gen: int,
    n_train: int,
    max_lag: int,
    samples_per_step: int,
    attempts: int,
    calib: Calibration,
    max_tokens: int,
    lengths: Lengths | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    seed: int = 0,
    filtered: float | None = None,
    wave_groups: int = 0,
    max_inflight: int | None = None,
    trace: list[tuple] | None = None,
) -> SimResult:
    """Simulate `steps` optimizer steps; rates and lag are measured after the first `warmup`.

    n_gen / n_train are devices; sync mode ignores max_lag (it is 0 there by definition).
    `filtered`: share of groups dropped by zero-variance filtering (default: the calibration's).
    `wave_groups`: groups per early wave of a streamed step in pipeline mode (`wave_groups`
    below; 0: the trainer waits for whole steps). `max_inflight`: groups an engine may run at
    once (the generator's `maxInflightGroups`; None: as many as its batch holds). `trace`, when
    given, receives what admission hears, in the generators' terms (test_admission replays it).
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
        raise ValueError(
            f"need at least one generator engine ({calib.gpus_per_engine} devices) and one trainer, "
            f"got {n_gen} and {n_train}"
        )
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be in [0, steps={steps})")
    filtered = calib.filtered_fraction if filtered is None else filtered
    if not 0 <= filtered < 1:
        raise ValueError(f"filtered ({filtered}) must be in [0, 1)")
    return _Sim(
        mode,
        n_gen,
        n_train,
        max_lag,
        samples_per_step,
        attempts,
        calib,
        max_tokens,
        lengths or calib.lengths,
        steps,
        warmup,
        seed,
        filtered,
        wave_groups,
        max_inflight,
        trace,
    ).run()


def wave_groups(job: PipelineRLJob, trainer_ranks: int, lengths: Lengths) -> int:
    """Groups in each early wave of a step streamed in pipeline mode (0: not streamed), as
    `steps.next_wave` forms them from groups of mean length: as many as one row per trainer
    rank is sure to hold."""
    spec = job.spec
    if spec.rl.token_weighting != "sample":
        return 0
    max_tokens = spec.generator.sampling.max_tokens
    completion = float(np.mean(lengths.sample(np.random.default_rng(0), 4096, max_tokens)))
    group = spec.rl.attempts * (lengths.prompt_tokens + completion)
    longest = lengths.prompt_tokens + max_tokens
    return max(1, int(wave_capacity(trainer_ranks, spec.trainer.micro_batch_tokens, longest) // group))
