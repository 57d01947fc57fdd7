"""Who is in the weight group (pure): membership epochs of the generators.

Each generator process says hello every few seconds (`GeneratorHello`: its pod index, an id of
this process, the weights it holds). The weight group of an epoch is trainer rank 0 plus the
generators listed for it. Trainer rank 0 opens a new epoch (a fresh group, under a fresh
rendezvous prefix) before a broadcast when the generators alive differ from the epoch's
members, or when the group broke. A generator that misses a deadline (does not join, does not
confirm an update in time, fails to load) is dropped, never waited for; once it says hello again
it joins the next epoch and first receives the current weights. Unless its hello says it is still
applying an update past the update deadline (`GeneratorHello.stuck`): its process answers while its engine does
not (a hung kernel, a device that stopped answering), so it could join no epoch, and inviting it
to each one would hold every generator's weights back by a join window each time. It is invited
again once its hellos say that update ended. Times are the caller's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Member:
    generator: int  # pod index
    incarnation: str  # one process of it: a restarted generator is a new member


@dataclass
class Membership:
    liveness_s: float  # a generator whose last hello is older is taken for gone
    epoch: int = 0  # epochs opened so far (0: no group yet)
    members: tuple[Member, ...] = ()  # of the current epoch, weight-group ranks 1.. in this order
    broken: bool = True  # the current group cannot be used again (or there is none)
    seen: dict[Member, float] = field(default_factory=dict)  # last hello
    holds: dict[Member, int] = field(default_factory=dict)  # the version each said it holds (-1: none)
    stuck: set[Member] = field(default_factory=set)  # whose newest hello said it is stuck in an update
    dropped: int = 0  # members dropped so far
    heard_after: float = float("-inf")  # only hellos newer than this count (see `suspect`)

    def hello(self, member: Member, version: int, now: float, stuck: bool = False) -> None:
        for old in [m for m in self.seen if m.generator == member.generator and m != member]:
            self._forget(old)  # the same pod restarted: its previous process is gone
        self.seen[member] = now
        # A hello sent before an update was confirmed must not take the member back.
        self.holds[member] = max(version, self.holds.get(member, -1))
        if stuck:
            self.stuck.add(member)
        else:
            self.stuck.discard(member)

    def alive(self, now: float) -> tuple[Member, ...]:
        return tuple(sorted(m for m, t in self.seen.items() if now - t <= self.liveness_s and t > self.heard_after))

    def ready(self, now: float) -> tuple[Member, ...]:
        """Alive, and not stuck in an update: those a new epoch can count on to join."""
        return tuple(m for m in self.alive(now) if m not in self.stuck)

    def suspect(self, now: float) -> None:
        """A broadcast failed and gloo cannot say who died: from now on count only the generators
        that say hello again (within a second), so the next epoch leaves the dead one out."""
        self.heard_after, self.broken = now, True

    def next_members(self, now: float) -> tuple[Member, ...] | None:
        """The members of the epoch to open before the next broadcast; None: keep the current one."""
        ready = self.ready(now)
        if not self.broken and set(ready) == set(self.members):
            return None
        return ready

    def open(self, members: tuple[Member, ...]) -> int:
        self.epoch += 1
        self.members, self.broken = members, False
        return self.epoch

    def drop(self, members: list[Member] | tuple[Member, ...]) -> None:
        """Out of the group (missed a deadline, failed): they rejoin by saying hello again."""
        for m in members:
            if m in self.seen:
                self.dropped += 1
                self._forget(m)
        if set(members) & set(self.members):
            self.broken = True

    def behind(self, version: int, now: float) -> list[Member]:
        """Ready members that said they hold weights older than `version`."""
        return [m for m in self.ready(now) if self.holds.get(m, -1) < version]

    def _forget(self, member: Member) -> None:
        self.seen.pop(member, None)
        self.holds.pop(member, None)
        self.stuck.discard(member)
