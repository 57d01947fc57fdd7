"""The job's training-problem claims (pure): which problem indices the generators have drawn, and
which a store made to go on from a checkpoint draws again.

Generators claim blocks of indices from one record on the CONTROL stream (`streams.claim_problems`):
every index below `Claims.next` is claimed, except those in `Claims.redraw`, which the next claims
take first. A group's id names its index (`group_id`); a trainer step's ledger settles the groups
it took (trained, filtered, stale or dead-lettered), and the trainer keeps the settled indices with
each checkpoint. A store lost and made to go on from that checkpoint (`store.recover_store`) draws
again every index claimed then and not settled by it (`Claims.unsettled`): the groups queued,
in flight or in a generator's unused block when the store was lost. No index settled by a step is
drawn again. A generator stopping gives back what it holds (`streams.give_back_problems`): the
next claims take it first, a peer's where the job no longer runs that rank (scaled down); a
generator killed outright leaves it to its restart (`streams.hold_problems`). Unsettled too, and
so drawn again at a recovery: a block claimed by a generator killed before it recorded it, the
groups of one killed inside its publish (that one's, and those waiting behind it; or stopped
while an index was let go: a record written for a group finishing beside it carried that
change), what a rank killed outright and then scaled away held, problems a generator skips (a
prompt too long for the model), a lost claim's indices, and a group that could not be decoded
(its index unknown). Those gaps never close otherwise, so the trainer keeps only the newest
`MAX_GAPS` (`newest_gaps`): the older are given up.

Index sets are sorted, disjoint half-open ranges `(start, stop)`; as text `3-5,9` (inclusive).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Range = tuple[int, int]  # [start, stop)
# The unsettled ranges a checkpoint keeps, the newest: a store lost mid-run leaves one or two per
# generator and step in flight. It bounds the record (the job's status, `recover-store --redraw`).
MAX_GAPS = 2048


def group_id(problem: str, index: int, rank: int) -> str:
    """A group's id, its message id in the rollout stream: the claimed index makes it the job's
    alone; a problem's own id comes back with each epoch of a dataset, and JetStream would drop
    the later group as a duplicate of the earlier within its window."""
    return f"{problem}#{index}@{rank}"


def claimed_index(group_id: str) -> int | None:
    """The problem index a group id names (`group_id`); None for another id (a message that could
    not be decoded is settled as `rollout-<sequence>`). A problem's own id may hold '#' and '@'."""
    _, hash_, tail = group_id.rpartition("#")
    index, at, _ = tail.partition("@")
    return int(index) if hash_ and at and index.isdigit() else None


def with_indices(ranges: Sequence[Range], indices: Iterable[int]) -> list[Range]:
    """`ranges` with `indices` added, merged."""
    merged: list[Range] = []
    for start, stop in sorted([*ranges, *((i, i + 1) for i in indices)]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def without_index(ranges: Sequence[Range], index: int) -> list[Range]:
    """`ranges` less `index`."""
    out: list[Range] = []
    for start, stop in ranges:
        out += [r for r in ((start, min(stop, index)), (max(start, index + 1), stop)) if r[0] < r[1]]
    return out


def indices(ranges: Sequence[Range]) -> list[int]:
    return [i for start, stop in ranges for i in range(start, stop)]


def newest_gaps(ranges: list[Range], most: int) -> list[Range]:
    """`ranges` leaving at most `most` gaps, the newest (highest): older ones are filled, given up."""
    if len(ranges) <= most + 1:
        return ranges
    cut = len(ranges) - most - 1
    return [(ranges[0][0], ranges[cut][1]), *ranges[cut + 1 :]]


def gaps(ranges: Sequence[Range], below: int) -> list[Range]:
    """The indices under `below` that `ranges` leave out."""
    out, at = [], 0
    for start, stop in ranges:
        if start >= below:
            break
        if start > at:
            out.append((at, start))
        at = max(at, stop)
    if at < below:
        out.append((at, below))
    return out


def ranges_text(ranges: Sequence[Range]) -> str:
    return ",".join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in ranges)


def parse_ranges(text: str, what: str) -> list[Range]:
    """`ranges_text`'s ranges back; ValueError naming `what` where `text` is not such a list."""
    indices: list[Range] = []
    for part in filter(None, text.split(",")):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"{what}: {part!r} is not an index or a range 'first-last' (as in '3-5,9')")
        indices.append((int(first), int(last if dash else first) + 1))
    return with_indices(indices, ())


@dataclass(frozen=True)
class Claims:
    next: int = 0  # every index below it is claimed, but those in `redraw`
    redraw: tuple[Range, ...] = ()  # below `next`: drawn again, first

    @classmethod
    def of(cls, problems: int, redraw: str = "", what: str = "redraw") -> Claims:
        """From their two fields as records carry them (`messages.Checkpointed`, the job's status,
        the CLI's options): the count and the redraw ranges' text."""
        ranges = parse_ranges(redraw, what)
        if ranges and ranges[-1][1] > problems:
            raise ValueError(f"{what}: {ranges_text(ranges)} reaches past the {problems} problems claimed")
        return cls(problems, tuple(ranges))

    @classmethod
    def parse(cls, text: str) -> Claims:
        """From the CONTROL stream's record (`text`): `N`, or `N;ranges`."""
        count, _, redraw = text.partition(";")
        if not count.isdigit():
            raise ValueError(f"the problem claims record {text[:80]!r} is not 'N' or 'N;ranges'")
        return cls.of(int(count), redraw, "the problem claims record's redraw")

    def text(self) -> str:
        return f"{self.next};{ranges_text(self.redraw)}" if self.redraw else str(self.next)

    @property
    def redraw_text(self) -> str:
        return ranges_text(self.redraw)

    def take(self, count: int) -> tuple[list[int], Claims]:
        """`count` indices claimed, those to draw again first; and the claims after."""
        taken: list[int] = []
        rest = list(self.redraw)
        while rest and len(taken) < count:
            start, stop = rest.pop(0)
            n = min(stop - start, count - len(taken))
            taken.extend(range(start, start + n))
            if start + n < stop:
                rest.insert(0, (start + n, stop))
        fresh = count - len(taken)
        return taken + list(range(self.next, self.next + fresh)), Claims(self.next + fresh, tuple(rest))

    def given_back(self, ranges: Sequence[Range]) -> Claims:
        """These claims with `ranges`, claimed and never drawn (a stopping generator's,
        `streams.give_back_problems`), to draw again first."""
        redraw = with_indices([*self.redraw, *ranges], ())
        if redraw and redraw[-1][1] > self.next:
            raise ValueError(f"problems given back {ranges_text(ranges)} reach past the {self.next} claimed")
        return Claims(self.next, tuple(redraw))

    @classmethod
    def unsettled(cls, claimed: int, settled: Sequence[Range]) -> Claims:
        """What a store made to go on from a checkpoint claims from: the `claimed` count then, and
        every index under it that no step up to the checkpoint `settled`, to draw again."""
        return cls(claimed, tuple(gaps(settled, claimed)))

    @classmethod
    def at_checkpoint(cls, state: dict) -> Claims:
        """From a trainer checkpoint's state (its state.json, `Position.kept`). A checkpoint from
        before the settled indices were kept draws nothing again (as then)."""
        claimed = state.get("problems_claimed", 0)
        settled = state.get("problems_settled", [[0, claimed]])
        return cls.unsettled(claimed, [(a, b) for a, b in settled])
