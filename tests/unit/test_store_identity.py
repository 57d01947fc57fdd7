"""Which store a trainer's position belongs to (`Position.check_store`, pure): a first start takes
the store, a restart in the same store goes on, a lost or replaced store is StoreLost (at a start
and while running), and only a store `recover-store` made for this very checkpoint is adopted."""

from pipelinerl import messages as m
from pipelinerl.claims import Claims
from pipelinerl_trainer.position import Position


def identity(id_: str, adopts: str | None = None, step: int | None = None) -> m.StoreIdentity:
    return m.StoreIdentity(id=id_, created=0.0, adopts=adopts, adopted_step=step)


def at_checkpoint(store: str, step: int = 4) -> Position:
    state = {"step": step, "consumed_seq": {"0": 57}, "trained_groups": {"0": 16}, "store": store}
    state |= {"problems_claimed": 40, "problems_settled": [[0, 30], [32, 40]]}
    return Position.restored(state, 0)


def test_a_first_start_takes_the_store_and_a_restart_in_it_goes_on():
    fresh = Position.restored({}, 0)
    assert fresh.check_store(identity("a")) == "" and fresh.store == "a"
    assert fresh.kept({"0": 0}, 12)["store"] == "a"
    old = Position.restored({"step": 3, "consumed_seq": {"0": 9}}, 0)  # from before stores had identities
    assert old.check_store(identity("a")) == "" and old.store == "a" and old.consumed_seq == 9
    # From before settled problems were kept: nothing drawn again (as then), not every problem.
    older = Position.restored({"step": 3, "store": "a", "problems_claimed": 40}, 0)
    assert older.claims() == Claims(40) and "--problems 40`" in older.check_store(identity("b"))
    same = at_checkpoint("a")
    assert same.check_store(identity("a")) == "" and same.consumed_seq == 57 and same.trained_groups == {"0": 16}


def test_a_lost_store_is_store_lost_with_the_recovery_named():
    p = at_checkpoint("a")
    lost = p.check_store(identity("b"))
    assert lost.startswith("StoreLost:") and "store a" in lost and "now b" in lost
    assert "--adopt a --step 4 --problems 40 --redraw 30-31`" in lost and "--run-dir" in lost
    assert "suspend the job, then resume it" in lost  # on a cluster the operator restores it
    assert "`pipelinerl recover-store JOB --nats URL -n NAMESPACE`, which reads that record" in lost
    # Ranges to draw again past what a message can carry are left to the record.
    many = Position.restored({"step": 4, "store": "a", "problems_claimed": 4000, "problems_settled": [
        [i, i + 1] for i in range(0, 4000, 2)]}, 0)  # fmt: skip
    said = many.check_store(identity("b"))
    assert "--problems 4000` and the 2000 ranges to draw again it names (too many to name here)" in said
    assert len(said) < 2000
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


def test_rank_0_tells_its_checkpoint_on_a_store_made_to_go_on_from_it():
    """A resumed job's store holds no record of the checkpoint it was made from until the next
    save: rank 0 tells it as it takes the store, so that a suspend before that save restores the
    store from it again (`main.await_store`). A store it goes on in, or takes first, is not told."""
    import threading
    from types import SimpleNamespace

    from pipelinerl.contracts import ServiceEnv
    from pipelinerl_trainer.main import await_store

    def told(position: Position, store: m.StoreIdentity, rank: int = 0) -> list:
        said: list = []
        bridge = SimpleNamespace(
            store_identity=lambda: store,
            publish=lambda subject, msg: said.append((subject, msg)),
            subjects=SimpleNamespace(checkpoint="ckpt"),
        )
        board = SimpleNamespace(update=lambda **kw: None)
        await_store(position, bridge, board, ServiceEnv(role="trainer", rank=rank), threading.Event())
        return said

    said = told(at_checkpoint("a"), identity("b", adopts="a", step=4))
    assert said == [("ckpt", m.Checkpointed(store="a", step=4, problems=40, redraw="30-31"))]
    assert told(at_checkpoint("a"), identity("b", adopts="a", step=4), rank=1) == []
    assert told(at_checkpoint("a"), identity("a")) == []
    assert told(Position.restored({}, 0), identity("a")) == []
