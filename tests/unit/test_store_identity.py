"""Which store a trainer's position belongs to (`Position.check_store`, pure): a first start takes
the store, a restart in the same store goes on, a lost or replaced store is StoreLost (at a start
and while running), and only a store `recover-store` made for this very checkpoint is adopted."""

from pipelinerl import messages as m
from pipelinerl_trainer.position import Position


def identity(id_: str, adopts: str | None = None, step: int | None = None) -> m.StoreIdentity:
    return m.StoreIdentity(id=id_, created=0.0, adopts=adopts, adopted_step=step)


def at_checkpoint(store: str, step: int = 4) -> Position:
    state = {"step": step, "consumed_seq": {"0": 57}, "trained_groups": {"0": 16}, "store": store}
    state["problems_claimed"] = 40
    return Position.restored(state, 0)


def test_a_first_start_takes_the_store_and_a_restart_in_it_goes_on():
    fresh = Position.restored({}, 0)
    assert fresh.check_store(identity("a")) == "" and fresh.store == "a"
    assert fresh.kept({"0": 0}, 12)["store"] == "a"
    old = Position.restored({"step": 3, "consumed_seq": {"0": 9}}, 0)  # from before stores had identities
    assert old.check_store(identity("a")) == "" and old.store == "a" and old.consumed_seq == 9
    same = at_checkpoint("a")
    assert same.check_store(identity("a")) == "" and same.consumed_seq == 57 and same.trained_groups == {"0": 16}


def test_a_lost_store_is_store_lost_with_the_recovery_named():
    p = at_checkpoint("a")
    lost = p.check_store(identity("b"))
    assert lost.startswith("StoreLost:") and "store a" in lost and "now b" in lost
    assert "--adopt a --step 4 --problems 40" in lost and "--run-dir" in lost
    assert "suspend the job, then resume it" in lost  # on a cluster the operator restores it
    assert p.store == "a" and p.consumed_seq == 57  # nothing taken from the other store
    running = at_checkpoint("a")
    assert "restarted trainer says how" in running.check_store(identity("b"), starting=False)


def test_only_a_store_recovered_for_this_checkpoint_is_adopted():
    assert at_checkpoint("a").check_store(identity("c", adopts="x", step=4))  # another store's
    assert at_checkpoint("a").check_store(identity("c", adopts="a", step=3))  # another checkpoint's
    assert at_checkpoint("a").check_store(identity("c", adopts="a", step=4), starting=False)  # never mid-run
    p = at_checkpoint("a")
    assert p.check_store(identity("c", adopts="a", step=4)) == ""
    # Its streams start empty: read from sequence 0, no group credited in them yet.
    assert (p.store, p.consumed_seq, p.step_seq, p.trained_groups, p.version) == ("c", 0, 0, {}, 4)
    assert p.kept({"0": 0}, 10)["problems_claimed"] == 40  # claims never go back
