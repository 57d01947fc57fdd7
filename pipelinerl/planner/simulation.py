"""Planner simulation: a discrete-event simulation of one run, pipeline or conventional.

Generators (continuous batching, in-flight weight updates) and trainers, driven by the
per-token costs of a calibration (`pipelinerl.planner.calibration`). Pure and deterministic
for a seed. The rules it simulates are imported, not restated: the generators' admission
(`pipelinerl.admission.lag_budget`) and the preprocessor's waves
(`pipelinerl.steps.wave_capacity`).

Its parameters, result and measuring window: `pipelinerl.planner.sim_params`. Modes (docs/planner.md):

- `pipeline`: generators and trainers on their own devices, concurrently; a step streams to
  the trainer in waves; weights are sent after every step and land on running sequences.
- `sync` with `steps_per_generation` k (conventional RL, k = 1: this project's sync mode): one
  generation phase of k steps' worth of groups on the newest weights, then k optimizer steps
  on consecutive mini-batches of it (in the order groups finish), weights sent once per
  phase. The trainer starts once the whole phase is generated (the preprocessor holds a
  phase's first step until then). Split: generators and trainers on their own devices, each
  idle in the other's phase; `colocated`: the same devices alternate, and every device trains.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipelinerl.admission import lag_budget
from pipelinerl.planner.sim_params import MAX_STEPS, MIN_STEPS, SimParams, SimResult


@dataclass(slots=True)
class _Engine:
    # Heap of (decode step it finishes at, decode step it started at, group).
    running: list[tuple[float, float, int]] = field(default_factory=list)
    waiting: deque[tuple[int, int]] = field(default_factory=deque)  # (length, group) beyond the engine's batch
    steps: float = 0.0  # decode steps done: every running sequence gains one token per step
    start_sum: float = 0.0  # sum of the running sequences' start steps (their contexts, summed)
    t_ref: float = 0.0  # wall time `steps` refers to
    free_at: float = 0.0  # paused (weight update) or prefilling until then
    token: int = 0  # invalidates this engine's scheduled event
    busy: float = 0.0  # time spent decoding
    held: float = 0.0  # time holding a group (decoding, prefilling, paused): a generator's busy time
    fill: float = 0.0  # integral of running sequences over time
    tokens: float = 0.0  # tokens decoded: decode steps times the sequences running in each
    groups: int = 0  # started, not finished (the generator's max_inflight_groups caps it)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


class _Sim:
    """One simulated run; `simulate` is the public entry point.

    Events: an engine's next sequence finish, the end of the trainer's compute of an early wave
    of a step ("wave") or of a whole step and its optimizer step ("trained"), and the end of a
    weight broadcast ("synced"). Between events every engine decodes at a rate that follows
    its running sequences' contexts: a decode step with n sequences of contexts c_i takes
    base + Σ (per_seq + per_token · c_i), and every c_i grows by one per step, so the step time
    grows linearly in the steps done and the time for a number of steps (and its inverse) is a
    quadratic in closed form. An engine's progress is banked (`_advance`) before anything that
    changes its rate.
    """

    def __init__(self, p: SimParams) -> None:
        assert p.lengths is not None and p.filtered is not None  # filled in by SimParams
        self.window_lifetimes, self.climb_lifetimes = p.window_lifetimes, p.climb_lifetimes
        self.c, self.attempts, self.max_tokens, self.lengths = p.calib, p.attempts, p.max_tokens, p.lengths
        self.filtered = p.filtered
        self.max_inflight = p.max_inflight if p.max_inflight is not None else 1 << 30
        self.mode, self.n_gen, self.n_train = p.mode, p.n_gen, p.n_train
        self.pipeline = p.mode == "pipeline"
        # Sync mode is max_lag 0: one phase of groups admitted, consumed only after the update.
        self.max_lag = p.max_lag if self.pipeline else 0
        self.k = 1 if self.pipeline else p.steps_per_generation
        self.colocated = p.colocated and not self.pipeline
        self.groups_per_step = p.samples_per_step // p.attempts
        # Pipeline mode streams a step to the trainer in waves of this many groups (0: whole
        # steps, as sync mode); a wave leaves once one more group is pending (steps.next_wave).
        self.wave_groups = p.wave_groups if self.pipeline else 0
        self.cap = p.calib.engine_batch(p.lengths, p.max_tokens, p.max_running)
        # The step last started, as the generators' Admission hears it from the trainer (none yet).
        # Only a pipeline with a lag budget hears it before the step ends; phased modes (sync,
        # conventional k) keep -1 and are held by `queued`, a whole phase's groups at a time.
        self.training_step = -1
        # What admission hears, as the generators' Admission calls, each with the budget and the
        # queue after it (simulate's `trace`).
        self.trace = p.trace
        self.fixed = p.steps is not None
        self.steps = p.steps if p.steps is not None else MAX_STEPS
        # Adaptive window: a sync phase (or a pipeline at max_lag 0, the same) needs no warm-up:
        # it starts from empty engines every time.
        self.phased = not self.max_lag
        self.min_warmup = p.warmup if p.warmup is not None else (0 if self.phased else 2)
        self.burst_end: int | None = None  # groups started before the first step ended: the start-up's
        self.burst_left = 0  # of those, still generating
        self.lag_settled = True
        self.warm_at: int | None = None  # the step the window starts after
        self.warm_t = 0.0
        self.stop = False
        self.rng = np.random.default_rng(p.seed)
        self.pool: list[int] = []
        self.engines = [_Engine() for _ in range(p.n_gen // p.calib.gpus_per_engine)]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.seq = 0  # tie-breaker: equal-time events run in the order they were scheduled
        self.now = 0.0
        # Per group: engine, weights version at its start, lengths, start decode step per
        # sequence, admission time.
        self.g_engine: list[int] = []
        self.g_version: list[int] = []
        self.g_lengths: list[list[int]] = []
        self.g_starts: list[list[float]] = []
        self.g_left: list[int] = []
        self.g_t0: list[float] = []
        self.g_drop: list[bool] = []  # zero-variance: dropped when it finishes, never trained
        self.longest = 0.0  # the longest group lifetime seen (admission to finish)
        # Groups still generating, by the version they started at (few versions, many groups:
        # the budget reads the oldest at every event).
        self.running: Counter[int] = Counter()
        self.oldest_running: int | None = None  # the smallest key of `running`
        self.n_dropped = 0
        self.queued = 0  # groups started and not yet consumed by the trainer (nor dropped)
        self.finished: deque[int] = deque()
        self.step_gids: list[int] = []  # groups of the step being trained, taken so far
        self.trained = 0  # groups in finished steps
        self.version = 0  # optimizer steps applied
        # Weight updates: the version each delivered and the decode step of every engine at
        # which it began (tokens decoded after it carry that version).
        self.update_versions: list[int] = []
        self.update_steps = np.zeros((64, len(self.engines)))  # row u: update u (grown by doubling)
        self.base = p.calib.decode_base_s
        self.per_seq = p.calib.decode_per_seq_s + p.calib.decode_per_token_s * p.lengths.prompt_tokens
        self.per_tok = p.calib.decode_per_token_s
        self.train_work = 1 + p.logprob_pass  # a baseline's own log-prob pass per trained token
        # An engine stalls once per group for its prefill (the attempts share the prompt: prefix
        # cache) and for each of its requests' own work.
        self.group_stall_s = p.calib.prefill_s_per_token * p.lengths.prompt_tokens + p.attempts * p.calib.request_s
        self.slow = 1.0  # decode slow-down while the trainer computes (contention)
        self.computing = self.syncing = False
        self.done = 0  # steps trained (and, at a phase's end, synced)
        self.step_end: list[float] = []
        self.train_busy = 0.0
        # Trained tokens by lag, measured steps only. A conventional phase trains its step j at lag j.
        self.lag_tokens = np.zeros((self.max_lag if self.pipeline else self.k - 1) + 1)
        self.dropped = 0.0
        self.snap = (0.0, 0.0, 0.0, 0.0)
        if not self.min_warmup:
            self.warm_at = 0  # measured from the start

    def _heard(self, event: str, *args: int | bool) -> None:
        if self.trace is not None:
            self.trace.append((event, *args, self.budget, self.queued))

    # -- engines --------------------------------------------------------------------------
    # The hot path (one call per sequence finish) is kept lean: the current decode step's time,
    # base + n·per_seq + per_tok·(n·steps − start_sum) (unslowed), is written out where it runs.
    def _advance(self, e: _Engine) -> None:
        now = self.now
        start = e.t_ref if e.t_ref > e.free_at else e.free_at
        n = len(e.running)
        if now > start and n:
            dt = now - start
            per_tok = self.per_tok
            a0 = self.base + n * self.per_seq + per_tok * (n * e.steps - e.start_sum)
            x = dt / self.slow
            # Steps d with a0·d + b·d²/2 = x (the step time grows by b = per_tok·n per step).
            d = 2 * x / (a0 + math.sqrt(a0 * a0 + 2 * per_tok * n * x)) if per_tok else x / a0
            e.steps += d
            e.tokens += d * n
            e.busy += dt
            e.fill += dt * n
        if e.groups:
            e.held += now - e.t_ref
        e.t_ref = now

    def _schedule(self, i: int) -> None:
        e = self.engines[i]
        e.token += 1
        n = len(e.running)
        if n:
            left = e.running[0][0] - e.steps
            if left < 0:
                left = 0.0
            start = self.now if self.now > e.free_at else e.free_at
            a0 = self.base + n * self.per_seq + self.per_tok * (n * e.steps - e.start_sum)
            dt = (a0 + self.per_tok * n * left / 2) * left * self.slow
            self.seq += 1
            heapq.heappush(self.events, (start + dt, self.seq, "gen", i, e.token))

    def _push(self, t: float, kind: str, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def _lengths(self, n: int) -> list[int]:
        """The next n lengths: popped one by one from a pool of 4096 draws, refilled when empty."""
        pool = self.pool
        if len(pool) >= n:
            out = pool[: -n - 1 : -1]
            del pool[-n:]
            return out
        out = []
        while len(out) < n:
            if not pool:
                pool.extend(self.lengths.sample(self.rng, 4096, self.max_tokens).tolist())
            take = min(n - len(out), len(pool))
            out.extend(reversed(pool[-take:]))
            del pool[-take:]
        return out

    def _start_group(self, i: int, schedule: bool = True) -> None:
        e = self.engines[i]
        self._advance(e)
        e.free_at = (e.free_at if e.free_at > self.now else self.now) + self.group_stall_s
        gid = len(self.g_engine)
        lengths = self._lengths(self.attempts)
        version = self.version if self.pipeline else self._weights
        self.g_engine.append(i)
        self.g_version.append(version)
        self.running[version] += 1
        if self.oldest_running is None:
            self.oldest_running = version  # groups start on the newest weights: never older than one running
        self.g_lengths.append(lengths)
        self.g_starts.append([])
        self.g_left.append(self.attempts)
        self.g_t0.append(self.now)
        # Drawn only when filtering is on, so a run without it keeps the same random stream.
        self.g_drop.append(self.filtered > 0 and self.rng.random() < self.filtered)
        self.queued += 1
        if self.trace is not None:
            self._heard("start", version)
        e.groups += 1
        e.waiting.extend([(n, gid) for n in lengths])
        self._fill(e)
        if schedule:
            self._schedule(i)

    @property
    def _weights(self) -> int:
        """The version the engines hold: the last one sent (0 before any)."""
        return self.update_versions[-1] if self.update_versions else 0

    def _fill(self, e: _Engine) -> None:
        # A group's sequences start in list order, so g_starts lines up with g_lengths.
        running, waiting, steps = e.running, e.waiting, e.steps
        while waiting and len(running) < self.cap:
            n, gid = waiting.popleft()
            heapq.heappush(running, (steps + n, steps, gid))
            e.start_sum += steps
            self.g_starts[gid].append(steps)

    @property
    def budget(self) -> int:
        # The generator's admission rule (Admission.budget) for the whole cluster, whose share
        # of a step is all of it: counted from the oldest group still generating. Conventional
        # k: one phase, k steps' worth of groups, on the weights of the newest step trained.
        oldest = self.version if self.oldest_running is None else self.oldest_running
        lag = self.max_lag if self.pipeline else self.k - 1
        return lag_budget(lag, self.groups_per_step, oldest, self.training_step, self.k)

    def _room(self, e: _Engine) -> bool:
        return len(e.running) + len(e.waiting) < self.cap and e.groups < self.max_inflight

    def _admit(self, prefer: int | None = None) -> None:
        """Start groups while the lag budget allows and an engine has room (a free batch slot,
        fewer than `max_inflight` groups running).

        After a finish only that engine gained room (`prefer`); after the trainer consumed
        groups, every engine may take some: least loaded first.
        """
        budget = self.budget  # starting a group never moves it (it starts on the newest weights)
        if prefer is not None:
            e = self.engines[prefer]
            while self.queued < budget and self._room(e):
                self._start_group(prefer, schedule=False)  # the caller schedules the engine
            return
        loads = [(e.load, i) for i, e in enumerate(self.engines) if self._room(e)]
        heapq.heapify(loads)
        while self.queued < budget and loads:
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

    def _group_done(self, e: _Engine, gid: int) -> bool:
        """A group's last sequence finished; True if it was the oldest still generating."""
        e.groups -= 1
        v = self.g_version[gid]
        running = self.running
        running[v] -= 1
        raised = False
        if not running[v]:
            del running[v]
            if v == self.oldest_running:
                self.oldest_running = min(running) if running else None
                raised = v < (self.version if self.oldest_running is None else self.oldest_running)
        if self.burst_end is not None and gid < self.burst_end:
            self.burst_left -= 1
        lifetime = self.now - self.g_t0[gid]
        if lifetime > self.longest:
            self.longest = lifetime
        if self.g_drop[gid]:
            # As the generator's admission (on_finish with discarded): the slot frees at once,
            # so the engine starts a replacement in both modes.
            self.queued -= 1
            self.n_dropped += 1
        else:
            self.finished.append(gid)
        if self.trace is not None:
            self._heard("finish", v, self.g_drop[gid])
        return raised

    def _on_engine(self, i: int, token: int) -> None:
        """An engine's next sequence finish (the hot path: `_advance` and `_schedule` written
        out, attributes read once)."""
        e = self.engines[i]
        if token != e.token:
            return  # superseded by a later schedule
        now, per_tok, slow = self.now, self.per_tok, self.slow
        base, per_seq = self.base, self.per_seq
        running = e.running
        # _advance
        start = e.t_ref if e.t_ref > e.free_at else e.free_at
        n = len(running)
        if now > start and n:
            dt = now - start
            a0 = base + n * per_seq + per_tok * (n * e.steps - e.start_sum)
            x = dt / slow
            d = 2 * x / (a0 + math.sqrt(a0 * a0 + 2 * per_tok * n * x)) if per_tok else x / a0
            e.steps += d
            e.tokens += d * n
            e.busy += dt
            e.fill += dt * n
        if e.groups:
            e.held += now - e.t_ref
        e.t_ref = now
        raised = False  # the oldest group still generating finished: every engine may gain budget
        g_left = self.g_left
        done_at = e.steps + 1e-6
        while running and running[0][0] <= done_at:
            _, started, gid = heapq.heappop(running)
            e.start_sum -= started
            g_left[gid] -= 1
            if not g_left[gid]:
                raised |= self._group_done(e, gid)
        waiting = e.waiting
        if waiting:
            cap, steps, g_starts = self.cap, e.steps, self.g_starts
            while waiting and len(running) < cap:  # _fill
                length, gid = waiting.popleft()
                heapq.heappush(running, (steps + length, steps, gid))
                e.start_sum += steps
                g_starts[gid].append(steps)
        elif not running:
            e.start_sum = 0.0  # no rounding left over
        if raised or (len(running) + len(waiting) < self.cap and e.groups < self.max_inflight):
            if self.queued < self.budget:
                self._admit(prefer=i)
                if raised:
                    self._admit()
        # _schedule
        e.token += 1
        n = len(running)
        if n:
            left = running[0][0] - e.steps
            if left < 0:
                left = 0.0
            start = now if now > e.free_at else e.free_at
            a0 = base + n * per_seq + per_tok * (n * e.steps - e.start_sum)
            self.seq += 1
            heapq.heappush(
                self.events, (start + (a0 + per_tok * n * left / 2) * left * slow, self.seq, "gen", i, e.token)
            )
        if not (self.computing or self.syncing):
            self._train()

    # -- trainer --------------------------------------------------------------------------
    def _train(self) -> None:
        if self.computing or self.syncing:
            return
        if not self.pipeline and self.running:
            # The conventional baseline trains a phase once it is all generated (the
            # preprocessor holds its first step until then: `steps.next_wave`); colocated, the
            # devices are busy generating it anyway.
            return
        need = self.groups_per_step - len(self.step_gids)
        last = len(self.finished) >= need
        if not last and not (self.wave_groups and len(self.finished) > self.wave_groups):
            return
        gids = [self.finished.popleft() for _ in range(need if last else self.wave_groups)]
        self.step_gids += gids
        measured = self.warm_at is not None
        if measured:
            self._record_lag(gids)
        if last and self.pipeline and self.max_lag:
            # Pipeline: consumed once the step is complete, so generation of the next groups
            # overlaps the rest of its training.
            self.queued -= self.groups_per_step
            self.training_step = self.done
            self._heard("trained", self.trained + self.groups_per_step, self.training_step)
            self._admit()
        tokens = sum(sum(self.g_lengths[g]) for g in gids) + len(gids) * self.attempts * self.lengths.prompt_tokens
        overlap = any(e.running for e in self.engines)
        seconds = self.c.train_s(tokens, self.n_train) * (1 + self.c.contention * overlap) * self.train_work
        sends = last and (self.version + 1) % self.k == 0  # the phase's last step sends weights
        seconds += self.c.optimizer_step_s if last else 0.0
        self.computing = True
        if self.c.contention:
            self._set_slow(1.0 + self.c.contention)
        if measured:
            self.train_busy += seconds + (self.c.weight_sync_s if sends else 0.0)
        self._push(self.now + seconds, "trained" if last else "wave", self.groups_per_step)

    def _on_wave(self) -> None:
        self.computing = False
        if self.c.contention:
            self._set_slow(1.0)
        self._train()

    def _on_trained(self, consumed: int) -> None:
        self.computing = False
        self.version += 1
        if self.version % self.k:
            # Conventional: more steps of this phase to take, on the same data; no weights sent.
            if self.c.contention:
                self._set_slow(1.0)
            self._step_done(consumed)
            self._window()
            self._train()
            return
        self.syncing = True
        for e in self.engines:
            self._advance(e)
            e.free_at = max(e.free_at, self.now) + self.c.pause_s
        if self.phased:
            # The next phase's weights: the generators count that phase's groups only
            # (pipelinerl.admission: a phased queue), the last phase's are consumed.
            self.queued -= self.k * consumed
        self._heard("weights", self.version)
        # Tokens decoded after this pause carry the new version.
        self.update_versions.append(self.version)
        u = len(self.update_versions) - 1
        if u == len(self.update_steps):
            self.update_steps = np.concatenate([self.update_steps, np.zeros_like(self.update_steps)])
        self.update_steps[u] = [e.steps for e in self.engines]
        self._set_slow(1.0)  # the trainer stopped computing; reschedules every engine
        self._push(self.now + self.c.weight_sync_s, "synced", consumed)

    def _on_synced(self, consumed: int) -> None:
        self.syncing = False
        self._step_done(consumed)
        if self.phased:
            # The trainer announces the phase trained; the next phase starts on the new weights.
            self._heard("trained", self.trained, self.done - 1)
        self._admit()
        self._window()
        if not self.stop:  # a step begun after the window closed would count in its lag and busy time
            self._train()

    def _step_done(self, consumed: int) -> None:
        self.trained += consumed
        self.step_gids = []
        self.done += 1
        self.step_end.append(self.now)

    def _window(self) -> None:
        """At a step's end, once its consequences (admission) are in: open or close the window."""
        if self.done % self.k:
            return  # the window opens and closes on whole phases
        if self.fixed:
            if self.done == self.min_warmup:
                self._open_window()
            if self.done >= self.steps:
                self.stop = True
        elif self.warm_at is None:
            if self.burst_end is None:
                self.burst_end = len(self.g_engine)
                self.burst_left = sum(1 for g in range(self.burst_end) if self.g_left[g])
            # A step's worth of groups waiting for the trainer: it is the bottleneck, and the lag
            # climbs until admission holds it (the queue fills the budget). A slow climb (the
            # generators barely faster) is cut off after CLIMB_LIFETIMES: the rate has settled,
            # the lag is still rising (`lag_settled` False).
            climbing = len(self.finished) >= self.groups_per_step and self.queued < self.budget
            if self.done >= self.min_warmup and not self.burst_left:
                if not climbing:
                    self._open_window()
                elif self.now >= self.climb_lifetimes * self.longest:
                    self.lag_settled = False
                    self._open_window()
        elif self.done - self.warm_at >= MIN_STEPS and (
            self.phased or self.now - self.warm_t >= self.window_lifetimes * self.longest
        ):
            self.stop = True
        if self.done >= MAX_STEPS:
            self.stop = True

    def _open_window(self) -> None:
        self.warm_at, self.warm_t = self.done, self.now
        self.snap = self._engine_totals()

    def _record_lag(self, gids: list[int]) -> None:
        """Split each sequence's tokens by version: decode steps before/after each update."""
        g_starts, g_lengths = self.g_starts, self.g_lengths
        eng = np.repeat([self.g_engine[g] for g in gids], self.attempts)
        start = np.array([x for g in gids for x in g_starts[g]])
        length = np.array([x for g in gids for x in g_lengths[g]], dtype=float)
        v0 = min(self.g_version[g] for g in gids)
        first = bisect_right(self.update_versions, v0)  # the updates after the oldest start version
        versions = [v0] + self.update_versions[first:]
        # at_least[j]: tokens with version >= versions[j] (decoded after update j's pause).
        at_least = [float(length.sum())]
        if first < len(self.update_versions):
            began = self.update_steps[first : len(self.update_versions)][:, eng]  # (updates, sequences)
            at_least += np.clip(start + length - began, 0, length).sum(axis=1).tolist()
        at_least.append(0.0)
        limit = len(self.lag_tokens) - 1
        for j, version in enumerate(versions):
            lag = self.version - version
            tokens = at_least[j] - at_least[j + 1]
            if lag > limit:
                self.dropped += tokens  # the trainer zero-weights tokens older than max_lag
            else:
                self.lag_tokens[lag] += tokens

    def _engine_totals(self) -> tuple[float, float, float, float]:
        for e in self.engines:
            self._advance(e)
        return (
            sum(e.busy for e in self.engines),
            sum(e.fill for e in self.engines),
            sum(e.tokens for e in self.engines),
            sum(e.held for e in self.engines),
        )

    def run(self) -> SimResult:
        self._admit()
        events, on_engine = self.events, self._on_engine
        while not self.stop:
            if not events:
                raise RuntimeError(f"simulation stalled at step {self.done}: no group can finish (a bug)")
            self.now, _, kind, a, b = heapq.heappop(events)
            if kind == "gen":
                on_engine(a, b)
            elif kind == "wave":
                self._on_wave()
            elif kind == "trained":
                self._on_trained(a)
            else:
                self._on_synced(a)
        assert self.warm_at is not None
        busy, fill, decoded, held = (x - y for x, y in zip(self._engine_totals(), self.snap))
        window = self.step_end[-1] - self.warm_t
        measured = self.done - self.warm_at
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
            gen_fill=min(fill / (n_eng * window * self.cap), 1.0),
            train_busy=min(self.train_busy / window, 1.0),
            samples_trained=self.trained * self.attempts,
            samples_in_flight=(sum(1 for n in self.g_left if n) + len(self.finished) + len(self.step_gids))
            * self.attempts,
            samples_started=len(self.g_engine) * self.attempts,
            samples_filtered=self.n_dropped * self.attempts,
            steps_per_generation=self.k,
            colocated=self.colocated,
            window_s=window,
            longest_s=self.longest,
            engine_batch=self.cap,
            gen_tokens_per_busy_s=decoded / busy if busy else 0.0,
            gen_tokens_per_held_s=decoded / held if held else 0.0,
            lag_settled=self.lag_settled,
        )


def simulate(*args: Any, **kwargs: Any) -> SimResult:
    """Simulate a run (its parameters: `SimParams`, in order); rates and lag are measured after
    a warm-up, over a window. Deterministic for a given seed."""
    return _Sim(SimParams(*args, **kwargs)).run()
