"""Where a trainer rank stands (pure): what a checkpoint keeps is what a restart goes on from,
and the three moments that change it."""

from pipelinerl.books import Outcome, StepLedger, credit
from pipelinerl_trainer.position import Position


def test_a_step_moves_the_position_and_the_checkpoint_keeps_it():
    p = Position.restored({}, rank=0)
    assert (p.version, p.consumed_seq, p.trained_groups) == (0, 0, {})
    ledger = StepLedger()
    credit(ledger, Outcome.TRAINED, "a#0@0", 0, 4, False)
    credit(ledger, Outcome.STALE, "b#1@1", 1, 4, False)
    credit(ledger, Outcome.FILTERED, "c#3@1", 1, 4, True)
    credit(ledger, Outcome.DEAD_LETTERED, "rollout-12", None, 0, False)  # not decodable: no index
    p.took(7)
    p.consumed(ledger)  # the final micro-batch: its groups are consumed, before the step is taken
    assert p.trained_groups == {"0": 1, "1": 1} and p.version == 0 and p.step_seq == 0
    p.took(9)
    p.stepped(samples=4, rejected_groups=2, rejected_samples=1)
    assert (p.version, p.step_seq, p.samples, p.rejected_groups, p.rejected_samples) == (1, 9, 4, 2, 1)
    p.took(11)  # part of the next step: a checkpoint resumes where the last whole step ended
    kept = p.kept({"0": p.step_seq, "1": 12}, problems_claimed=6)
    assert kept["problems_settled"] == [[0, 2], [3, 4]]  # whatever the outcome
    again = Position.restored(kept, rank=0)
    assert again == Position(
        version=1,
        trained_groups={"0": 1, "1": 1},
        consumed_seq=9,
        step_seq=9,
        checkpointed=1,
        samples=4,
        rejected_groups=2,
        rejected_samples=1,
        problems_claimed=6,
        problems_settled=[(0, 2), (3, 4)],
    )
    assert Position.restored(kept, rank=1).consumed_seq == 12
    p.saved(kept)
    assert p.checkpointed == 1
    # What a store made to go on from it claims from: past the 6 claimed, 2, 4 and 5 drawn again first.
    told = p.record("s")
    assert (told.store, told.step, told.problems, told.redraw) == ("s", 1, 6, "2,4-5")


def test_the_settled_problems_keep_only_the_newest_gaps():
    """Gaps that never close (problems skipped as too long, blocks left by restarted generators)
    would grow the checkpoint and the store's record without bound: the oldest are given up."""
    from pipelinerl.claims import MAX_GAPS

    p = Position.restored({}, rank=0)
    for i in range(MAX_GAPS + 10):
        ledger = StepLedger()
        credit(ledger, Outcome.TRAINED, f"p#{2 * i}@0", 0, 4, False)  # every odd index a gap
        p.consumed(ledger)
    p.saved(p.kept({"0": 0}, problems_claimed=2 * (MAX_GAPS + 10)))
    redraw = p.claims().redraw  # the newest gaps between settled indices, and the last claimed index
    assert len(redraw) == MAX_GAPS + 1 and redraw[0] == (19, 20)  # 1, 3, ..., 17 given up
    assert redraw[-1] == (2 * MAX_GAPS + 19, 2 * MAX_GAPS + 20)
