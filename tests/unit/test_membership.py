"""Membership epochs of the weight group as pure state transitions (pipelinerl_trainer.membership)."""

from pipelinerl.messages import GeneratorHello
from pipelinerl_trainer.membership import Member, Membership

A, B = Member(0, "a1"), Member(1, "b1")


def test_first_epoch_forms_from_the_generators_alive():
    m = Membership(liveness_s=5)
    assert m.next_members(0.0) == ()  # nobody yet: an empty group means no broadcast
    m.hello(B, -1, 0.0)
    m.hello(A, -1, 0.5)
    assert m.next_members(1.0) == (A, B)  # ranks by pod index
    assert m.open((A, B)) == 1 and not m.broken
    assert m.next_members(2.0) is None  # unchanged: the group is kept


def test_join_opens_a_new_epoch_and_the_joiner_is_behind():
    m = Membership(liveness_s=5)
    m.hello(A, 3, 0.0)
    m.open((A,))
    m.hello(B, -1, 1.0)  # a generator added while the job runs
    assert m.next_members(1.5) == (A, B)
    assert m.behind(3, 1.5) == [B]  # it holds no weights: it is sent the current ones
    assert m.open((A, B)) == 2


def test_drop_on_a_missed_deadline_then_rejoin():
    m = Membership(liveness_s=5)
    for g in (A, B):
        m.hello(g, 1, 0.0)
    m.open((A, B))
    m.drop([B])  # did not confirm an update in time
    assert m.broken and m.dropped == 1
    assert m.next_members(1.0) == (A,)  # training goes on with the others
    m.open((A,))
    m.hello(B, 1, 2.0)  # still alive: says hello again
    assert m.next_members(2.0) == (A, B)


def test_silent_generator_ages_out():
    m = Membership(liveness_s=5)
    m.hello(A, 1, 0.0)
    m.hello(B, 1, 0.0)
    m.open((A, B))
    m.hello(A, 1, 4.0)
    assert m.next_members(4.0) is None
    assert m.next_members(6.0) == (A,)  # B killed: no hello for longer than the liveness window


def test_restarted_generator_replaces_its_previous_process():
    m = Membership(liveness_s=5)
    m.hello(A, 2, 0.0)
    m.hello(B, 2, 0.0)
    m.open((A, B))
    b2 = Member(1, "b2")  # the pod came back: same index, new process
    m.hello(b2, -1, 1.0)
    assert m.alive(1.0) == (A, b2)
    assert m.next_members(1.0) == (A, b2)
    assert m.behind(2, 1.0) == [b2]


def test_trainer_restart_starts_over_and_everyone_rejoins():
    # A restarted trainer has a fresh Membership: the generators that kept running say hello
    # with the weights they hold, and all of them form its first epoch.
    m = Membership(liveness_s=5)
    m.hello(A, 7, 0.0)
    m.hello(B, 6, 0.2)
    assert m.broken and m.next_members(0.5) == (A, B)
    assert m.behind(5, 0.5) == [] and m.behind(7, 0.5) == [B]


def test_after_a_failed_broadcast_only_generators_heard_from_again_count():
    m = Membership(liveness_s=10)
    m.hello(A, 4, 0.0)
    m.hello(B, 4, 0.0)
    m.open((A, B))
    m.suspect(0.5)  # B died mid-broadcast; its last hello is still within the liveness window
    assert m.broken and m.next_members(0.6) == ()  # nobody yet: no epoch formed around a corpse
    m.hello(A, 4, 1.0)
    assert m.next_members(1.1) == (A,)


def test_a_generator_stuck_in_an_update_is_invited_to_no_epoch_until_that_update_ends():
    # Its process says hello while its engine does not answer (a hung kernel): the update it is
    # applying runs past the deadline, so it could join no epoch. The others go on without it.
    def stuck(busy_s: float) -> bool:
        return GeneratorHello(generator=1, incarnation="b1", version=4, busy_seconds=busy_s).stuck(6)

    assert not stuck(0.0) and not stuck(3.0) and not stuck(6.0) and stuck(7.0)
    m = Membership(liveness_s=10)
    m.hello(A, 4, 0.0)
    m.hello(B, 4, 0.0)
    m.open((A, B))
    m.hello(B, 4, 3.0, stuck=stuck(3.0))  # an update under way, within its deadline: still counted on
    assert m.next_members(3.0) is None
    m.drop([B])  # did not confirm in time
    m.hello(A, 5, 7.0)
    m.hello(B, 4, 7.0, stuck=stuck(7.0))  # alive, but still in the update it was dropped from
    assert m.alive(7.0) == (A, B) and m.ready(7.0) == (A,) and m.stuck == {B}
    assert m.next_members(7.0) == (A,)
    m.open((A,))
    assert m.next_members(8.0) is None and m.behind(5, 8.0) == []  # no resend to it either
    m.hello(A, 9, 20.0)
    m.hello(B, 4, 20.0, stuck=stuck(20.0))
    assert m.next_members(20.0) is None
    m.hello(B, 4, 21.0)  # the update ended (failed: it kept version 4): back in the next epoch
    assert m.stuck == set()
    assert m.next_members(21.0) == (A, B) and m.behind(9, 21.0) == [B]
