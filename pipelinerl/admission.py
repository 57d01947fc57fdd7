"""Max-lag admission (pure): when may a generator start another prompt group?

A group started now, at weights version e, is trained once every group queued before it has
been consumed by the trainer. With Q groups of this generator queued or in flight (started,
not yet consumed, not discarded) and this generator's share of a step being
groups_per_step / generators, the new group is consumed by step N + Q // share, N being the
next step to start; its lag stays within `max_lag` while Q < (max_lag + e − N + 1) · share.
While step N − 1 trains, the generator holds its input weights (e = N − 1): Q < max_lag ·
share. Once that step's update has landed and until step N starts, e = N: one more share, so
the generator never idles waiting for the announcement of a step whose data it already made.
The trainer does not wait for an update to land before it trains on, so a step may also start
while the generator still holds the weights before its input's (e = N − 2): one share less.
Groups the preprocessor will discard (zero variance, or not trainable: `steps.counts_as_discarded`)
leave the queue as soon as they finish, so sync mode (one generation phase at a time, see
`lag_budget`) can never starve a step.

Groups are consumed in the order they *finish*, not the order they start: a long group is
overtaken by every shorter one started after it. So e above is the oldest start version among
the groups still in flight, not the engine's: no group admitted while a long one runs may push
that one past max_lag. (With the engine's version, a backlog kept at the budget put every group
that took more than a step to generate over it, and its oldest tokens were dropped: on a
long-tailed task, most of the long completions.) A long group thus holds admission back as
its lag nears max_lag: max_lag should exceed the steps the longest completions take to
generate, or the generator idles while they finish.

Steps fill from every generator in the order groups finish, so one generator's forecast that
its own share goes into each step breaks when another runs ahead: a generator that joins (or
restarts) behind a backlog its peers queued while it was gone, or a slow generator whose groups
the others' shorter ones overtake, had its groups trained steps later than forecast, their tokens
past max_lag. So each generator also hears its peers' queues and their oldest group still
generating (`on_peer`, from their hellos) and admits only while (a) its own queue is under its
share of the budget counted from the oldest group in flight anywhere, and (b) the whole cluster's
queue is under the whole step's budget. Own shares sum to the step, so (b) binds only behind a
peer over its share (a backlog from a smaller membership): then only generators under their
share start groups, and the room they share is what (a) leaves each. A peer silent for
`peer_ttl_s` is forgotten (`expire_peers`): its groups in flight died with it.

The queue counts every incarnation's groups: `published` and `discarded` continue from the
generator's books in the stream, so a restarted generator neither over- nor under-fills it
(groups of a dead incarnation are still trained). A group is published once, whatever the
retries: its id is the job's alone, and JetStream stores a retry of it once.

A phased run (the conventional baseline, `phased`) counts its queue by phase instead: the groups
this generator started on the phase's weights, less those it discarded. Nothing is consumed
while a phase trains (its budget is 0 then), and once the next phase's weights land every group
of an older one was trained or is surplus, which the preprocessor drops as too old, settled only
by the next phase's first step. Generators that join at different times overshoot a phase (the
first one counts the whole step as its share until the others arrive): counted by the trainer's
credits, that surplus would hold every queue full until a step that needs those very
generators' groups, and the run would wait forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def phased(max_lag: int, steps_per_generation: int) -> bool:
    """Generation in phases, one set of weights each, nothing generated while a phase trains: the
    conventional baseline (k = `steps_per_generation` > 1), or max_lag 0 (k = 1)."""
    return steps_per_generation > 1 or max_lag == 0


def lag_budget(max_lag: int, share: int, oldest: int, training_step: int, steps_per_generation: int = 1) -> int:
    """Groups one may have queued (started, neither consumed nor discarded): `share` per step
    of lag. `oldest` is the weights version of the oldest group still generating (the engine's
    weights e when none is), `training_step` the step N - 1 last announced as started; their
    difference, at most 1, is 1 once that step's update has landed, 0 while it trains, -1 while
    the weights before its input's still load.

    The conventional baseline (sync mode: k = `steps_per_generation` steps per phase, max_lag
    k - 1; also pipeline mode with max_lag 0, k = 1) generates a phase of k steps with the weights
    of the newest step trained and nothing while the phase trains: its steps are announced as
    trained one by one, but the weights come only after the last. The generators' `Admission`
    and the planner's simulation both call this."""
    if phased(max_lag, steps_per_generation):
        return steps_per_generation * share if oldest > training_step else 0
    return max(0, max_lag + min(1, oldest - training_step)) * share


@dataclass(frozen=True)
class Peer:
    """What another generator said of its admission in its newest hello."""

    queued: int
    oldest: int | None  # the weights version of its oldest group still generating; None: none runs
    seen: float  # when heard (the caller's clock: the generator's awake time)


@dataclass
class Admission:
    groups_per_step: int
    generators: int
    max_lag: int
    max_inflight: int
    steps_per_generation: int = 1  # k of the conventional baseline (sync mode)
    # trainer.maxSteps: weights of this version are the last; a group started on them would never
    # be trained (sync mode would generate a whole phase while the trainer checkpoints and ends)
    max_steps: int | None = None
    started: int = 0  # by this process
    finished: int = 0  # by this process
    published: int = 0  # groups in the stream, every incarnation's
    discarded: int = 0  # of those, ones never trained (steps.counts_as_discarded)
    trained: int = 0  # this generator's groups in trained steps (announced by the trainer)
    training_step: int = -1  # the last step announced as started (N - 1)
    weights_version: int = -1  # this generator's engine weights (e); -1: none from the trainer yet
    running: list[int] = field(default_factory=list)  # the weights version each group in flight started at
    peers: dict[int, Peer] = field(default_factory=dict)  # other generators, by rank
    peer_ttl_s: float = 5.0
    # phased: groups started by this process on each weights version, less those discarded
    phase_groups: dict[int, int] = field(default_factory=dict)

    @property
    def share(self) -> int:
        return math.ceil(self.groups_per_step / self.generators)

    @property
    def oldest(self) -> int:
        """The weights version a group started now is counted from: the oldest group still
        generating here or at a peer (a group on older weights is the one whose lag a new group
        can raise), or this engine's weights, which a group started now gets."""
        peers = [p.oldest for p in self.peers.values() if p.oldest is not None]
        return min([self.weights_version, *self.running, *peers])

    @property
    def budget(self) -> int:
        # With max_lag ≥ 1 the trainer reports groups as consumed when a step *starts* (so
        # generation overlaps training), and max_lag steps of unconsumed groups keep every lag
        # ≤ max_lag, one more once the weights of the step in training have landed.
        return lag_budget(self.max_lag, self.share, self.oldest, self.training_step, self.steps_per_generation)

    @property
    def cluster_room(self) -> int:
        """Groups the whole cluster may still start: the whole step's budget less every queue."""
        budget = lag_budget(
            self.max_lag, self.groups_per_step, self.oldest, self.training_step, self.steps_per_generation
        )
        return budget - self.queued - sum(p.queued for p in self.peers.values())

    @property
    def queued(self) -> int:
        if phased(self.max_lag, self.steps_per_generation):
            return self.phase_groups.get(self.weights_version, 0)  # this phase's (see the module's doc)
        return self.published - self.discarded - self.trained + self.inflight

    @property
    def inflight(self) -> int:
        return len(self.running)

    def may_start(self) -> bool:
        return (
            self.weights_version >= 0
            and (self.max_steps is None or self.weights_version < self.max_steps)
            and self.queued < self.budget
            and self.cluster_room > 0
            and self.inflight < self.max_inflight
        )

    def on_start(self) -> int:
        """A group starts: returns the weights version it starts at, for `on_finish`."""
        self.started += 1
        self.running.append(self.weights_version)
        self.phase_groups[self.weights_version] = self.phase_groups.get(self.weights_version, 0) + 1
        return self.weights_version

    def on_finish(self, started_at: int, discarded: bool) -> None:
        """A group started at `started_at` was published (`discarded`: one it counts as such)."""
        self.finished += 1
        self.running.remove(started_at)
        self.published += 1
        self.discarded += int(discarded)
        if discarded and started_at in self.phase_groups:  # no place in the phase
            self.phase_groups[started_at] -= 1

    def abandon(self, started_at: int) -> None:
        """A group started at `started_at` was given up before it was published (its problem
        cannot be generated): no place in the queue, nor in the phase."""
        self.running.remove(started_at)
        if started_at in self.phase_groups:
            self.phase_groups[started_at] -= 1

    def on_trained(self, trained_total: int, training_step: int = -1) -> None:
        # Announcements can arrive out of order after reconnects: never go backwards.
        self.trained = max(self.trained, trained_total)
        self.training_step = max(self.training_step, training_step)

    def on_peer(self, rank: int, queued: int, oldest: int | None, now: float) -> None:
        self.peers[rank] = Peer(queued, oldest, now)

    def forget_peer(self, rank: int) -> None:
        """A peer stuck in a weight update past its deadline (its process answers, its engine does
        not): counted as gone, as the trainer counts it. Its groups in flight cannot finish in
        time, and their old version would keep every other generator's admission shut."""
        self.peers.pop(rank, None)

    def expire_peers(self, now: float) -> None:
        """Forget peers silent for longer than `peer_ttl_s` (dead: their groups in flight are lost)."""
        self.peers = {r: p for r, p in self.peers.items() if now - p.seen <= self.peer_ttl_s}

    def on_weights(self, version: int, generators: int) -> None:
        """New weights loaded, sent to `generators` generators: the step is shared among them. The
        engine's version, even an older one (never expected, said where it happens): the hello
        reports it, and the trainer then sends the newest weights again."""
        self.weights_version = version
        self.generators = generators
        self.phase_groups = {v: n for v, n in self.phase_groups.items() if v >= self.weights_version}
