"""The books (pure): a group's four outcomes credited in one place, a step's counts read from its
entries, the ledger's wire form, and what a restart restores from the newest stored micro-batches.
(Under random interleavings and kills: test_books_property.py.)"""

import msgpack
import pytest

from pipelinerl import messages as m
from pipelinerl.books import (
    GeneratorBooks,
    Outcome,
    StepLedger,
    credit,
    restore,
    settle_again,
    undecodable_id,
)


def test_each_outcome_is_credited_to_its_generator_unless_it_counted_the_group_discarded():
    ledger = StepLedger()
    credit(ledger, Outcome.TRAINED, "a@0", 0, 4, discarded=False)
    credit(ledger, Outcome.TRAINED, "b@1", 1, 4, discarded=False)
    credit(ledger, Outcome.FILTERED, "c@1", 1, 4, discarded=True)
    credit(ledger, Outcome.STALE, "d@0", 0, 4, discarded=False)
    credit(ledger, Outcome.DEAD_LETTERED, "e@1", 1, 4, discarded=False)  # e.g. too long
    credit(ledger, Outcome.DEAD_LETTERED, "f@1", 1, 4, discarded=True)  # NaN rewards read as zero variance
    credit(ledger, Outcome.DEAD_LETTERED, undecodable_id(17), None, 0, discarded=False)
    settle_again(ledger, "z@0")  # settled by an earlier step: counted nowhere here
    assert ledger.credits == {"0": 2, "1": 2}  # a, d; b, e
    assert (ledger.trained_groups, ledger.samples, ledger.filtered, ledger.dead_lettered, ledger.stale_samples) == (
        2,
        8,
        1,
        3,
        4,
    )
    named = ["a@0", "b@1", "c@1", "d@0", "e@1", "f@1", "rollout-17", "z@0"]
    assert all(ledger.knows(g) for g in named) and not ledger.knows("y@0")
    assert not ledger.settles("z@0")  # handed back, settled by its own step
    # Once their wave is stored, the untrained groups are folded into counts: the books read the same.
    counts = (ledger.credits, ledger.filtered, ledger.dead_lettered, ledger.stale_samples, ledger.sampled_reward)
    ledger.waves = 1
    ledger.fold()
    assert [e.id for e in ledger.groups] == ["a@0", "b@1"]
    assert (ledger.credits, ledger.filtered, ledger.dead_lettered, ledger.stale_samples, ledger.sampled_reward) == (
        counts
    )
    assert all(ledger.knows(g) for g in named) and not ledger.knows("y@0")
    # Outcomes that contradict the generator's own count are refused, naming the group.
    with pytest.raises(ValueError, match="group g@0: filtered, but not counted discarded by its generator"):
        credit(ledger, Outcome.FILTERED, "g@0", 0, 4, discarded=False)
    with pytest.raises(ValueError, match="group h@0: trained, but counted discarded"):
        credit(ledger, Outcome.TRAINED, "h@0", 0, 4, discarded=True)


def test_the_policys_reward_counts_the_filtered_groups_the_trained_one_does_not():
    """Binary rewards, groups of 4: two mixed groups trained (1 and 3 right), an all-right and
    an all-wrong one filtered, a stale and a dead-lettered one left out. The policy's reward is
    that of the 16 samples it took, 8 right; the trained samples' alone is 4 of 8 whatever the
    filtered groups say."""
    ledger = StepLedger()
    assert ledger.sampled_reward is None
    credit(ledger, Outcome.TRAINED, "a", 0, 4, False, reward_sum=1.0)
    credit(ledger, Outcome.TRAINED, "b", 0, 4, False, reward_sum=3.0)
    credit(ledger, Outcome.FILTERED, "c", 0, 4, True, reward_sum=4.0)
    credit(ledger, Outcome.FILTERED, "d", 0, 4, True, reward_sum=0.0)
    credit(ledger, Outcome.STALE, "e", 0, 4, False, reward_sum=4.0)
    credit(ledger, Outcome.DEAD_LETTERED, "f", 0, 4, False)
    assert ledger.sampled_reward == 8 / 16
    credit(ledger, Outcome.FILTERED, "g", 0, 4, True, reward_sum=4.0)  # one more solved
    assert ledger.sampled_reward == 12 / 20


def test_entries_are_numbered_by_the_wave_that_acknowledges_them():
    ledger = StepLedger()
    credit(ledger, Outcome.TRAINED, "a", 0, 2, False)
    ledger.waves = 1
    credit(ledger, Outcome.STALE, "b", 0, 2, False)
    credit(ledger, Outcome.TRAINED, "c", 0, 2, False)
    credit(ledger, Outcome.TRAINED, "d", 0, 2, False)
    assert [e.wave for e in ledger.groups] == [0, 1, 1, 1]
    assert ledger.wave_groups(0) == ["a"] and ledger.wave_groups(1) == ["c", "d"]


def test_the_ledger_rides_on_the_micro_batch_compactly_and_is_checked_by_field():
    ledger = StepLedger(generators={"0": GeneratorBooks(published=9, discarded=2)})
    credit(ledger, Outcome.TRAINED, "p12@0", 0, 8, False, reward_sum=3.0)
    ledger.waves, ledger.wave_last, ledger.closed = 1, 0, True
    mb = m.MicroBatch(step=3, rank=0, index=0, last=True, ledger=ledger)
    data = m.encode(mb)
    assert m.decode(data, m.MicroBatch) == mb
    body = msgpack.unpackb(data)
    assert body["ledger"]["groups"] == [["p12@0", 0, "trained", 8, True, 0, 3.0]]  # an entry is a list on the wire
    body["ledger"]["groups"][0][3] = -1
    with pytest.raises(m.MessageError, match=r"micro_batch: ledger\.groups\.0\.samples"):
        m.decode(msgpack.packb(body), m.MicroBatch)
    body["ledger"]["groups"][0] = ["p12@0", 0, "trained"]
    with pytest.raises(m.MessageError, match="a ledger entry has 7 fields"):
        m.decode(msgpack.packb(body), m.MicroBatch)


def test_an_older_build_refuses_the_ledger_by_its_schema_version():
    body = msgpack.unpackb(m.encode(m.MicroBatch(step=0, rank=0, index=0)))
    body["v"] = 5  # the loose fields' schema
    with pytest.raises(m.MessageError, match="schema version 5 unsupported"):
        m.decode(msgpack.packb(body), m.MicroBatch)


def batch(step, rank, index, ledger, last=False, groups=()):
    return m.MicroBatch(step=step, rank=rank, index=index, last=last, ledger=ledger, group_ids=list(groups))


def wave_ledger(waves: int, first: int, last_index: int, trained: list[list[str]], closed=False, settled=()):
    """A step's ledger after `waves` waves: trained groups of each wave, `settled` (stale) with the last."""
    ledger = StepLedger()
    for wave, ids in enumerate(trained):
        ledger.waves = wave
        for g in ids:
            credit(ledger, Outcome.TRAINED, g, 0, 2, False)
    for g in settled:
        credit(ledger, Outcome.STALE, g, 1, 2, False)
    ledger.waves, ledger.wave_first, ledger.wave_last, ledger.closed = waves, first, last_index, closed
    return ledger


def members(settled) -> set[str]:
    return {g for g in ("a", "b", "c", "d", "s", "z") if g in settled}


def test_a_restart_from_nothing_starts_at_step_zero():
    r = restore([None, None])
    assert (r.step, r.next_index, r.torn, r.ledger) == (0, 0, None, StepLedger())
    assert "a" not in r.settled


def test_a_restart_after_a_whole_step_starts_the_next_and_knows_what_it_settled():
    done = wave_ledger(2, 1, 1, [["a"], ["b", "c"]], closed=True, settled=["s"])
    done.generators = {"0": GeneratorBooks(published=5), "1": GeneratorBooks(published=2, discarded=1)}
    older = done.model_copy(update={"generators": {"0": GeneratorBooks(published=4)}})
    r = restore([batch(3, 0, 1, done, last=True), batch(3, 1, 1, older, last=True)])
    assert (r.step, r.next_index, r.torn) == (4, 0, None)
    assert r.ledger == StepLedger(generators=done.generators)  # the newest books of each generator, carried on
    assert members(r.settled) == {"a", "b", "c", "s"}  # handed back after a lost acknowledgement: settled again


def test_a_restart_between_two_waves_continues_the_step():
    partial = wave_ledger(2, 2, 3, [["a", "b"], ["c"]], settled=["s"])
    r = restore([batch(5, 0, 3, partial), batch(5, 1, 3, partial)])
    assert (r.step, r.next_index, r.torn) == (5, 4, None)
    assert r.ledger.trained_groups == 3 and r.ledger.groups == partial.groups  # the step's books so far
    assert members(r.settled) == {"a", "b", "c", "s"}
    r.ledger.groups.append(r.ledger.groups[0])
    assert len(partial.groups) == 4  # a copy: the stored ledger is left alone


def test_a_wave_stored_on_some_ranks_only_is_to_be_published_again():
    # Wave 1 of step 5 (indices 2-3) reached rank 0 whole, rank 1 in part, rank 2 not at all.
    before = wave_ledger(1, 0, 1, [["a"]])
    torn = wave_ledger(2, 2, 3, [["a"], ["b", "c"]], closed=True, settled=["s"])
    r = restore(
        [batch(5, 0, 3, torn, last=True, groups=["c"]), batch(5, 1, 2, torn, groups=["b"]), batch(5, 2, 1, before)]
    )
    assert r.step == 5 and r.torn is not None
    assert (r.torn.groups, r.torn.first, r.torn.stored) == (["b", "c"], 2, {0: 3, 1: 2, 2: 1})
    assert r.torn.newest == {0: ["c"], 1: ["b"]} and r.torn.ledger == torn
    # Its groups come back to be packed again, not settled as handed back; its stale one is settled.
    assert members(r.settled) == {"a", "s"}


def test_a_wave_stored_in_part_on_one_rank_is_torn_too():
    torn = wave_ledger(1, 0, 2, [["a", "b", "c"]])
    r = restore([batch(0, 0, 1, torn, groups=["a"])])  # index 2 of the wave was never stored
    assert r.torn is not None and r.torn.stored == {0: 1} and r.torn.groups == ["a", "b", "c"]
    whole = restore([batch(0, 0, 2, torn, groups=["c"])])
    assert whole.torn is None and (whole.step, whole.next_index) == (0, 3)
