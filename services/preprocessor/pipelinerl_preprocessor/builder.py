"""The step the preprocessor is building (pure: the service does the I/O around it).

Groups come in and are recorded in the step's ledger with their outcome (`books.credit`): taken
for a step (`take`: filtered there, or accepted), dead-lettered (`dead_lettered`), too old for the
step (`drop_stale`), or delivered again after it was taken or settled (`returned`: after a restart
or a pause that outlasted the acknowledgement wait). `next_wave` says what to
store next: part of the step (`steps.next_wave`), its micro-batches each carrying the ledger as of
that wave, and the messages to acknowledge once they are all stored; or, once a step's worth of
groups is settled with nothing to train, a wave of the books alone.

A restarted builder (from `books.restore`) goes on with the step its predecessor was building:
the groups its predecessor held come back unacknowledged and go into that step, the one they were
made for (closed short, the step would lose them, and the next step would take them too old); a
wave stored in part is published again first, as it was. It publishes nothing until it has been
handed every group left in the stream at its start (`caught_up`, the service says when), so the
groups its predecessor held, and those handed back after a lost acknowledgement, are all known
before its first wave.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipelinerl.books import Outcome, Restored, Settled, StepLedger, Torn, credit, newest_books, settle_again
from pipelinerl.messages import MicroBatch, RolloutGroup
from pipelinerl.spec import JobSpec
from pipelinerl.steps import counts_as_discarded, filtered, hopelessly_stale, next_wave, steps_left_in_phase
from pipelinerl_preprocessor.advantages import group_advantages
from pipelinerl_preprocessor.packing import StepSample, fill_ranks, pack_wave, step_weight


@dataclass
class Wave:
    step: int
    batches: list[MicroBatch]  # to store, every rank's
    acks: list[Any]  # the messages to acknowledge once every micro-batch is stored
    last: bool  # it ends the step
    groups: int  # trained groups in it
    again: bool = False  # a wave stored in part before a restart, published again (its missing micro-batches)
    lost: list[str] = field(default_factory=list)  # groups of such a wave that never came back


class StepBuilder:
    def __init__(self, spec: JobSpec, ranks: int, restored: Restored, caught_up: bool = False):
        self.spec, self.ranks = spec, ranks
        self.step = restored.step
        self.ledger = restored.ledger
        self.index = restored.next_index  # the step's next micro-batch index, on every rank
        self.settled_before = restored.settled
        self.torn: Torn | None = restored.torn
        self.accepted: list[tuple[Any, RolloutGroup]] = []  # (message, group) waiting for a wave, unacknowledged
        # (message, ledger entry id) of groups in no micro-batch: acknowledged with the next wave
        self.settled: list[tuple[Any, str]] = []
        self.caught_up = caught_up  # every group left in the stream at the start has been handed over
        # Every stream sequence at or below the mark is settled: a message there delivered again
        # was settled already (`returned`), however many steps ago. Restored: the stored books'
        # mark, and the sequences settled above it; it passes only settled ones (`_advance`).
        self.mark = restored.settled_through
        self.seqs: dict[str, int] = {}  # the stream sequence of each message held, by entry id
        # The sequences settled above the mark, restored ones included: every ledger stored names
        # them until the mark passes them (a restored one left out, a second restart would take
        # that message, delivered again by a nats-server restart, for a new one).
        self.settled_seqs: set[int] = set(restored.settled_above)

    def torn_waits(self) -> bool:
        """A wave stored in part has a group not handed over (yet): published again without it, the
        ranks would be evened out with sentinels and its samples lost (`_again`)."""
        if self.torn is None:
            return False
        back = {g.group_id for _, g in self.accepted} | {entry for _, entry in self.settled}  # (settled: refused)
        return not set(self.torn.groups) <= back

    def held(self) -> list[Any]:
        """Messages taken and not yet acknowledged."""
        return [ref for ref, _ in self.accepted + self.settled]

    def note_books(self, group: RolloutGroup) -> None:
        key = str(group.generator)
        self.ledger.generators[key] = newest_books(group.books, self.ledger.generators.get(key))

    def returned(self, ref: Any, group_id: str, seq: int) -> bool:
        """A group delivered again (stream sequence `seq`) that this builder holds already, or
        that a step settled: handed back because a kill lost its acknowledgement (the previous
        process's newest step: `settled_before`), because a restarted nats-server forgot the
        consumer's newest deliveries and so dropped their acknowledgements (any step's: its
        sequence settled), or delivered again to this live consumer because a pause (SIGSTOP, a
        frozen node, a long stall) outlasted the acknowledgement wait. Acknowledged with the next
        wave, never taken or credited twice (True); False for a group not seen before. Known by its
        sequence only where that was settled: a delivery lost on the way (a dropped connection)
        comes again after later ones, and is new."""
        # Held: the newest delivery takes the place of the earlier one, acknowledged with the wave
        # that stores the group (acknowledged sooner, the message would go before it is stored).
        for i, (_, group) in enumerate(self.accepted):
            if group.group_id == group_id:
                self.accepted[i] = (ref, group)
                return True
        for i, (_, entry) in enumerate(self.settled):
            if entry == group_id:
                self.settled[i] = (ref, entry)
                return True
        again = group_id in (self.torn.groups if self.torn else ())  # of a wave stored in part: stored again
        if self.ledger.knows(group_id) and not again:  # settled by this step's earlier waves
            pass
        elif group_id in self.settled_before or (not again and (seq <= self.mark or seq in self.settled_seqs)):
            settle_again(self.ledger, group_id)  # an earlier step's: acknowledged with this one
        else:
            self.seqs[group_id] = seq
            return False  # new
        self.seqs[group_id] = seq  # held again, till the wave that acknowledges it is stored
        self.settled.append((ref, group_id))
        return True

    def gone_below(self, first_seq: int) -> None:
        """The rollout stream holds no message below `first_seq` (a work queue removes what is
        acknowledged, and only settled messages are): none can come again, so the mark passes
        the sequences there this builder never saw (deliveries lost on the way, taken since by
        none), which would otherwise hold it back and grow every ledger's `settled_above`."""
        self._advance(first_seq - 1)

    def dead_lettered(self, ref: Any, entry_id: str, group: RolloutGroup | None) -> None:
        """A message that cannot be trained (`group` None: not even decoded), kept aside by the
        service with its reason."""
        discarded = group is not None and counts_as_discarded(self.spec, group)
        generator, samples = (group.generator, len(group.samples)) if group is not None else (None, 0)
        credit(self.ledger, Outcome.DEAD_LETTERED, entry_id, generator, samples, discarded)
        self.settled.append((ref, entry_id))

    def _credit(self, outcome: Outcome, group: RolloutGroup, discarded: bool = False) -> None:
        samples = group.samples
        reward_sum = sum(s.reward for s in samples)
        credit(self.ledger, outcome, group.group_id, group.generator, len(samples), discarded, reward_sum)

    def take(self, ref: Any, group: RolloutGroup) -> Outcome | None:
        """A group that can be trained: filtered (returned), or accepted for a wave (None). It
        passed the checks, so its generator counted it discarded exactly when it is filtered."""
        if filtered(self.spec, group):
            self._credit(Outcome.FILTERED, group, discarded=True)
            self.settled.append((ref, group.group_id))
            return Outcome.FILTERED
        self.accepted.append((ref, group))
        return None

    def drop_stale(self) -> list[RolloutGroup]:
        """Groups too old for the step being built take no place in it (their generator's queue
        counts them as consumed by it); those of a wave to publish again stay."""
        again = set(self.torn.groups) if self.torn else set()
        keep, dropped = [], []
        for ref, group in self.accepted:
            if group.group_id in again or not hopelessly_stale(group, self.step, self.spec.max_lag):
                keep.append((ref, group))
                continue
            self._credit(Outcome.STALE, group)
            self.settled.append((ref, group.group_id))
            dropped.append(group)
        self.accepted = keep
        return dropped

    def next_wave(self) -> Wave | None:
        """The next wave to store, if one is due; the builder counts it stored from here on (a
        failure to store it stops the service, whose successor restores from what was stored)."""
        if not self.caught_up:
            return None
        if self.torn is not None:
            return self._again(self.torn)
        n, last = next_wave(
            [[len(s.tokens) for s in g.samples] for _, g in self.accepted],
            self.ledger.trained_groups,
            self.spec.groups_per_step,
            self.ranks,
            self.spec.trainer.micro_batch_tokens,
            self.spec.streams_steps,
            steps_left_in_phase(self.step, self.spec.steps_per_generation),
        )
        if not n and not last and len(self.settled) < self.spec.groups_per_step:
            return None
        # With none to train (n = 0): a wave of books only, one sentinel per rank that stores the
        # ledger, so the groups settled meanwhile are acknowledged. They leave ROLLOUTS only then,
        # and admission does not bound them (filtered groups): a step that waits for its whole
        # phase (sync mode, token weighting) would otherwise hold them until ROLLOUTS is full,
        # and the generators, refused, would wait with it.
        take, self.accepted = self.accepted[:n], self.accepted[n:]
        for _, group in take:
            self._credit(Outcome.TRAINED, group)
        per_rank = self._pack([g for _, g in take], self.index, last)
        count = len(per_rank[0])
        self.ledger.fold()  # the earlier waves' untrained groups: counted, no longer named
        self.ledger.waves += 1
        self.ledger.wave_first, self.ledger.wave_last, self.ledger.closed = self.index, self.index + count - 1, last
        acks = [ref for ref, _ in take + self.settled]
        self._settle([g.group_id for _, g in take] + [entry for _, entry in self.settled])
        self.settled = []
        batches = self._carrying([mb for mbs in per_rank for mb in mbs], self.ledger)
        wave = Wave(self.step, batches, acks, last, len(take))
        self._stored(last)
        return wave

    def _again(self, torn: Torn) -> Wave:
        """The wave a kill left stored in part: packed again from the same groups in the same
        order (packing is deterministic), its micro-batches not yet stored published. If some of
        its groups never came back (the stream lost them), the ranks are evened out with
        sentinels instead, and the samples not stored are lost (named in `Wave.lost`). It carries
        the ledger it was stored with: of the groups settled since, only those that ledger
        names (handed back) are acknowledged with it, the others wait for the next wave."""
        self.torn = None
        found, again = {g.group_id: (ref, g) for ref, g in self.accepted}, set(torn.groups)
        self.accepted = [(ref, g) for ref, g in self.accepted if g.group_id not in again]
        take = [found[i] for i in torn.groups if i in found]
        lost = [i for i in torn.groups if i not in found]
        last, wave_last = torn.ledger.closed, torn.ledger.wave_last
        if lost:
            batches = fill_ranks(self.step, torn.stored, wave_last, last)
        else:
            per_rank = self._pack([g for _, g in take], torn.first, last)
            for rank, ids in torn.newest.items():
                mbs = per_rank[rank] if rank < len(per_rank) else []  # (a job now of fewer ranks)
                repacked = next((mb for mb in mbs if mb.index == torn.stored[rank]), None)
                if repacked is None or repacked.group_ids != ids or mbs[-1].index != wave_last:
                    now = f"{repacked.group_ids}" if repacked is not None else "nothing"
                    raise RuntimeError(
                        f"step {self.step}: the wave stored in part before the restart packs differently "
                        f"now (rank {rank}, micro-batch {torn.stored[rank]}: {now} where {ids} is stored)"
                    )
            batches = [mb for rank, mbs in enumerate(per_rank) for mb in mbs if mb.index > torn.stored[rank]]
        named = Settled(torn.ledger)
        wave = Wave(
            self.step,
            self._carrying(batches, torn.ledger),
            [ref for ref, _ in take] + [ref for ref, entry in self.settled if entry in named],
            last,
            len(take),
            again=True,
            lost=lost,
        )
        self._settle([g.group_id for _, g in take] + [entry for _, entry in self.settled if entry in named])
        self.settled = [(ref, entry) for ref, entry in self.settled if entry not in named]
        self.ledger.returned = [i for i in self.ledger.returned if i not in named]
        self._stored(last)
        return wave

    def _pack(self, groups: list[RolloutGroup], first_index: int, last: bool) -> list[list[MicroBatch]]:
        samples = []
        for group in groups:
            adv = group_advantages([s.reward for s in group.samples], self.spec.rl.normalize_advantages)
            samples += [StepSample(s, a, group.group_id) for s, a in zip(group.samples, adv)]
        weight = step_weight(samples, self.spec.rl.token_weighting, self.spec.trainer.samples_per_step)
        return pack_wave(
            self.step, samples, self.ranks, self.spec.trainer.micro_batch_tokens, weight, first_index, last
        )

    def _settle(self, ids: list[str]) -> None:
        """The wave being stored settles `ids`: their sequences, and its ledger's mark."""
        self.settled_seqs.update(self.seqs.pop(entry) for entry in ids if entry in self.seqs)
        self._advance(self.mark)

    def _advance(self, floor: int) -> None:
        """The mark: at least `floor`, then over every sequence settled right above it; never
        lowered (a message delivered again below it was settled before). Not over a sequence
        not seen yet: a delivery lost on the way comes again later, and is new then."""
        mark = max(self.mark, floor)
        while mark + 1 in self.settled_seqs:
            mark += 1
        self.mark = mark
        self.settled_seqs = {seq for seq in self.settled_seqs if seq > mark}
        self.ledger.settled_through, self.ledger.settled_above = self.mark, sorted(self.settled_seqs)

    def _carrying(self, batches: list[MicroBatch], ledger: StepLedger) -> list[MicroBatch]:
        snapshot = ledger.snapshot()  # the builder's own goes on changing
        for mb in batches:
            mb.ledger = snapshot
        return batches

    def _stored(self, last: bool) -> None:
        """A wave is stored: the next one's index, or a new step, which takes over the groups
        settled since and not yet acknowledged (after a wave published again only)."""
        if not last:
            self.index = self.ledger.wave_last + 1
            return
        waiting = [e.model_copy(update={"wave": 0}) for e in self.ledger.groups if e.wave == self.ledger.waves]
        self.settled_before = Settled(self.ledger)  # delivered again later: known (`returned`)
        self.step, self.index = self.step + 1, 0
        self.ledger = StepLedger(groups=waiting, generators=dict(self.ledger.generators))
