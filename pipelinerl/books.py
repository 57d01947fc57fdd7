"""The books (pure): what became of every rollout group, carried with the data itself, so that no
crash can leave them out of step with it (docs/architecture.md, "The books").

Every group a generator publishes is settled once, by the step the preprocessor is building when
it takes the group, with one of four outcomes (`Outcome`): trained in that step, filtered (zero
variance), stale (too old for the step) or dead-lettered (it cannot be trained).

- `GeneratorBooks`: a generator's groups published and discarded, carried by each group it
  publishes (`RolloutGroup.books`);
- `StepLedger`: what one step has settled so far, group by group, and each generator's newest
  books; carried once on every micro-batch (`MicroBatch.ledger`), the final wave's being the
  step's. Its counts (samples, filtered, dead-lettered, stale samples, credits) are read from its
  entries, never kept beside them, but for the untrained groups of its earlier waves, folded into
  counts and index ranges (`Folded`): a step may settle many times its trained groups (most
  filtered: a task too hard or too easy), and a ledger naming each on every micro-batch of every
  wave grew with their square, past NATS's largest message;
- `credit`: the one place a group's outcome is recorded, and whether it frees a place in its
  generator's admission queue (`GroupEntry.credited`): the trainer sums a step's `credits` into
  `trained_groups` when the step is consumed;
- `restore`: from the newest micro-batch stored on every trainer rank, where a restarted
  preprocessor goes on (the step it was building, continued, not closed short; a wave it stored in
  part, published again), which groups were settled already (handed back after a kill lost their
  acknowledgement, they are settled again uncounted), and every generator's newest books (which a
  restarted generator continues from). The generator and the preprocessor both call it.

What a step and a version are (step N trains at version N, and the other conventions the books
rely on) is `pipelinerl.steps`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, overload

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pipelinerl.claims import Range, claimed_index, with_indices


class GeneratorBooks(BaseModel):
    """A generator's books once a group is published, carried by that group (no separate write
    that a crash could leave behind). A restarted generator continues from its newest group:
    still in the rollout stream, or taken, then in the preprocessor's record of the books of the
    groups it took (`StepLedger.generators`)."""

    model_config = ConfigDict(extra="forbid")
    published: int = Field(default=0, ge=0)  # its groups in the stream, every incarnation's, this one included
    discarded: int = Field(default=0, ge=0)  # of those, ones dropped on sight (steps.counts_as_discarded)


@overload
def newest_books(first: GeneratorBooks, /, *books: GeneratorBooks | None) -> GeneratorBooks: ...
@overload
def newest_books(*books: GeneratorBooks | None) -> GeneratorBooks | None: ...
def newest_books(*books: GeneratorBooks | None) -> GeneratorBooks | None:
    """The newest of a generator's books (they only grow, group by group)."""
    known = [b for b in books if b is not None]
    return max(known, key=lambda b: b.published) if known else None


class Outcome(StrEnum):
    TRAINED = "trained"  # in a micro-batch of the step
    FILTERED = "filtered"  # zero variance, and the job filters those: its generator counted it discarded
    STALE = "stale"  # every token older than the step accepts (`steps.hopelessly_stale`)
    DEAD_LETTERED = "dead_lettered"  # cannot be trained (the preprocessor's checks, or not decodable)


ENTRY_FIELDS = ("id", "generator", "outcome", "samples", "credited", "wave", "reward_sum")


class GroupEntry(BaseModel):
    """One group a step settled. On the wire a list in `ENTRY_FIELDS` order (a step's ledger
    rides on each of its micro-batches: compact)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str  # the group id; `rollout-<sequence>` for a message that could not be decoded
    generator: int | None  # None: not known (not decodable)
    outcome: Outcome
    samples: int = Field(ge=0)
    credited: bool  # frees a place in its generator's admission queue (not one it counted discarded)
    wave: int = Field(ge=0)  # the wave of the step that acknowledged it
    reward_sum: float = 0.0  # its samples' rewards summed (0 where dead-lettered: not trusted)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: Any) -> Any:
        if isinstance(data, (list, tuple)):
            if len(data) != len(ENTRY_FIELDS):
                raise ValueError(f"a ledger entry has {len(ENTRY_FIELDS)} fields {ENTRY_FIELDS}, not {len(data)}")
            return dict(zip(ENTRY_FIELDS, data))
        return data

    @model_serializer
    def _as_list(self) -> list:
        return [self.id, self.generator, self.outcome.value, self.samples, self.credited, self.wave, self.reward_sum]


class Folded(BaseModel):
    """The untrained groups (filtered, stale, dead-lettered) of a step's earlier waves, as counts
    and the problem indices their ids name (`claims.claimed_index`): all any reader asks of them
    once their wave is stored (`StepLedger.fold`)."""

    model_config = ConfigDict(extra="forbid")
    filtered: int = Field(default=0, ge=0)
    dead_lettered: int = Field(default=0, ge=0)
    stale_samples: int = Field(default=0, ge=0)
    filtered_samples: int = Field(default=0, ge=0)  # the policy's reward counts filtered groups too
    filtered_reward: float = 0.0
    credits: dict[str, int] = Field(default_factory=dict)  # by generator, as `StepLedger.credits`
    indices: list[Range] = Field(default_factory=list)  # merged half-open ranges
    unindexed: list[str] = Field(default_factory=list)  # ids naming no index (`undecodable_id`): rare

    def add(self, e: GroupEntry) -> None:
        if e.outcome == Outcome.FILTERED:
            self.filtered += 1
            self.filtered_samples += e.samples
            self.filtered_reward += e.reward_sum
        elif e.outcome == Outcome.DEAD_LETTERED:
            self.dead_lettered += 1
        else:
            self.stale_samples += e.samples
        if e.credited:
            self.credits[str(e.generator)] = self.credits.get(str(e.generator), 0) + 1
        index = claimed_index(e.id)
        if index is None:
            self.unindexed.append(e.id)
        else:
            self.indices = with_indices(self.indices, [index])

    def holds(self, group_id: str) -> bool:
        index = claimed_index(group_id)
        if index is None:
            return group_id in self.unindexed
        return any(start <= index < stop for start, stop in self.indices)


class StepLedger(BaseModel):
    """What a step has settled up to a wave, carried by every micro-batch of that wave."""

    model_config = ConfigDict(extra="forbid")
    # In the order settled (trained: packed); of the untrained ones, only those of the newest wave
    # and after it: the earlier are folded.
    groups: list[GroupEntry] = Field(default_factory=list)
    folded: Folded = Field(default_factory=Folded)
    # Settled by an earlier step (and credited there), handed back after a kill lost their
    # acknowledgement: acknowledged again with this step, counted nowhere.
    returned: list[str] = Field(default_factory=list)
    # The newest books of each generator (by rank) among every group the preprocessor has taken
    # so far, whole run: a group taken but in no stored wave is acknowledged only once this is.
    generators: dict[str, GeneratorBooks] = Field(default_factory=dict)
    # Every ROLLOUTS message at or below this stream sequence is settled by this wave or an earlier
    # one, and so are those at these sequences above it (a message still waiting holds the mark
    # back): one delivered again after a restart (nats-server's, or the preprocessor's) was taken once.
    settled_through: int = Field(default=0, ge=0)
    settled_above: list[int] = Field(default_factory=list)
    waves: int = Field(default=0, ge=0)  # waves of the step stored, this one included
    wave_first: int = Field(default=0, ge=0)  # this wave's first micro-batch index (on every rank)
    wave_last: int = Field(default=-1, ge=-1)  # and its last (every rank gets as many)
    closed: bool = False  # this wave ends the step

    def snapshot(self) -> StepLedger:
        """A copy that later changes to this one leave alone (entries are immutable)."""
        return self.model_copy(
            update={
                "groups": list(self.groups),
                "folded": self.folded.model_copy(deep=True),
                "returned": list(self.returned),
                "generators": dict(self.generators),
                "settled_above": list(self.settled_above),
            }
        )

    def fold(self) -> None:
        """Fold the untrained entries of the waves stored so far (`Folded`): the next wave's
        ledger names only the groups it acknowledges, and the step's trained ones."""
        kept = []
        for e in self.groups:
            if e.outcome != Outcome.TRAINED and e.wave < self.waves:
                self.folded.add(e)
            else:
                kept.append(e)
        self.groups = kept

    def entries(self, outcome: Outcome) -> list[GroupEntry]:
        return [e for e in self.groups if e.outcome == outcome]

    @property
    def trained_groups(self) -> int:
        return len(self.entries(Outcome.TRAINED))

    @property
    def samples(self) -> int:
        """Samples in the step's micro-batches."""
        return sum(e.samples for e in self.entries(Outcome.TRAINED))

    @property
    def filtered(self) -> int:
        return len(self.entries(Outcome.FILTERED)) + self.folded.filtered

    @property
    def sampled_reward(self) -> float | None:
        """Mean reward of the samples the step took, trained or filtered: the policy's reward.
        The trained ones alone are biased where zero-variance groups are filtered (with 0/1
        rewards their mean tends to 1/2 whatever the policy). None: the step took none."""
        took = self.entries(Outcome.TRAINED) + self.entries(Outcome.FILTERED)
        samples = sum(e.samples for e in took) + self.folded.filtered_samples
        reward = sum(e.reward_sum for e in took) + self.folded.filtered_reward
        return reward / samples if samples else None

    @property
    def dead_lettered(self) -> int:
        return len(self.entries(Outcome.DEAD_LETTERED)) + self.folded.dead_lettered

    @property
    def stale_samples(self) -> int:
        """Samples of groups too old for the step: dropped for lag by the preprocessor."""
        return sum(e.samples for e in self.entries(Outcome.STALE)) + self.folded.stale_samples

    @property
    def credits(self) -> dict[str, int]:
        """Groups of each generator (by rank) the step frees from its admission queue."""
        return dict(Counter(str(e.generator) for e in self.groups if e.credited) + Counter(self.folded.credits))

    def settles(self, group_id: str) -> bool:
        """Whether the step's waves settle the group (not one handed back: `returned`)."""
        return any(e.id == group_id for e in self.groups) or self.folded.holds(group_id)

    def knows(self, group_id: str) -> bool:
        """Whether the group is acknowledged with the step's waves: settled by them, or handed back."""
        return self.settles(group_id) or group_id in self.returned

    def settled_indices(self) -> list[Range]:
        """The problem indices the step settled (`claims`), as merged ranges."""
        return with_indices(self.folded.indices, [i for e in self.groups if (i := claimed_index(e.id)) is not None])

    def wave_groups(self, wave: int) -> list[str]:
        """The trained groups of one wave, in the order they were packed."""
        return [e.id for e in self.groups if e.wave == wave and e.outcome == Outcome.TRAINED]


def undecodable_id(sequence: int) -> str:
    """The ledger's name for a rollout message that could not be decoded (no group id to name it):
    by its stream sequence, which a redelivery keeps (also its dead letter's message id)."""
    return f"rollout-{sequence}"


def credit(
    ledger: StepLedger,
    outcome: Outcome,
    group_id: str,
    generator: int | None,
    samples: int,
    discarded: bool,
    reward_sum: float = 0.0,
) -> GroupEntry:
    """Record a group's outcome in the step being built, acknowledged with its next wave.

    Its generator counts a group as queued until a step consumes it, unless it counted it as
    discarded itself (`steps.counts_as_discarded`: zero variance where the job filters those, or
    not trainable): every other group, trained or not, is credited to it. A filtered group is discarded by
    definition; a trained or stale one never is (the filter comes first)."""
    if (outcome == Outcome.FILTERED) != discarded and outcome != Outcome.DEAD_LETTERED:
        raise ValueError(
            f"group {group_id}: {outcome.value}, but {'' if discarded else 'not '}counted discarded by its generator"
        )
    entry = GroupEntry(
        id=group_id,
        generator=generator,
        outcome=outcome,
        samples=samples,
        credited=generator is not None and not discarded,
        wave=ledger.waves,
        reward_sum=reward_sum,
    )
    ledger.groups.append(entry)
    return entry


def settle_again(ledger: StepLedger, group_id: str) -> None:
    """A group an earlier step settled, handed back because a kill lost its acknowledgement:
    acknowledged with this step's next wave, credited to nobody (it was, once)."""
    ledger.returned.append(group_id)


class StoredBatch(Protocol):
    """What `restore` reads of a stored micro-batch (`messages.MicroBatch`)."""

    step: int
    index: int
    last: bool
    group_ids: list[str]
    ledger: StepLedger


@dataclass(frozen=True)
class Torn:
    """A wave that a kill left stored on some ranks only, or in part on one: its groups were not
    acknowledged, so they come back, and it is published again as it was (`pack_wave` is
    deterministic), its micro-batches not yet stored only."""

    groups: list[str]  # its trained groups, in the order they were packed
    first: int  # its first micro-batch index
    stored: dict[int, int]  # rank -> the last index of the step stored on it (-1: none)
    newest: dict[int, list[str]]  # rank -> the group ids of its newest stored micro-batch of the wave
    ledger: StepLedger  # the wave's, carried again by the micro-batches published now


@dataclass(frozen=True)
class Settled:
    """The groups a stored step's waves acknowledged (`StepLedger.knows`), less `but` (those of a
    wave stored in part: stored again)."""

    ledger: StepLedger = field(default_factory=StepLedger)
    but: frozenset[str] = frozenset()

    def __contains__(self, group_id: object) -> bool:
        return isinstance(group_id, str) and group_id not in self.but and self.ledger.knows(group_id)


@dataclass(frozen=True)
class Restored:
    step: int  # the step to build: the newest stored, if it is not complete, else the next
    ledger: StepLedger  # that step's ledger so far (a new step's: every generator's newest books only)
    next_index: int  # the next micro-batch index of the step, on every rank
    # Groups the newest stored step settled (trained ones included): handed back after a kill lost
    # their acknowledgement, they are settled again, uncounted (`settle_again`).
    settled: Settled
    torn: Torn | None  # a wave stored in part, to publish again first
    settled_through: int = 0  # the newest wave's `StepLedger.settled_through`
    settled_above: frozenset[int] = frozenset()  # and its `settled_above`

    @property
    def generators(self) -> dict[str, GeneratorBooks]:
        return self.ledger.generators


def restore(newest: Sequence[StoredBatch | None]) -> Restored:
    """Where the books stand, from the newest micro-batch stored on each trainer rank (None:
    nothing yet). A wave is stored before the groups in it are acknowledged, and the next wave
    only after that, so only the newest stored wave can be stored in part; its ledger is the
    newest (that of the step stored last, with the most waves), and says which groups were
    settled (its own, and any at or below its mark or at a sequence it names above it: a
    nats-server restart can lose the acknowledgements of several steps)."""
    known = [b for b in newest if b is not None]
    if not known:
        return Restored(step=0, ledger=StepLedger(), next_index=0, settled=Settled(), torn=None)
    generators: dict[str, GeneratorBooks] = {}
    for b in known:
        for g, books in b.ledger.generators.items():
            generators[g] = newest_books(books, generators.get(g))
    step = max(b.step for b in known)
    top = max((b for b in known if b.step == step), key=lambda b: b.ledger.waves).ledger
    ledger = top.snapshot()
    ledger.generators = generators
    stored = {r: (b.index if b is not None and b.step == step else -1) for r, b in enumerate(newest)}
    torn = None
    if any(i < top.wave_last for i in stored.values()):
        wave = top.waves - 1
        torn = Torn(
            groups=top.wave_groups(wave),
            first=top.wave_first,
            stored=stored,
            newest={
                r: list(b.group_ids) for r, b in enumerate(newest) if b is not None and stored[r] >= top.wave_first
            },
            ledger=top.snapshot(),
        )
    settled = Settled(top.snapshot(), frozenset(torn.groups if torn else ()))
    through, above = top.settled_through, frozenset(top.settled_above)
    if top.closed and torn is None:
        return Restored(step + 1, StepLedger(generators=generators), 0, settled, None, through, above)
    return Restored(step, ledger, top.wave_last + 1, settled, torn, through, above)
