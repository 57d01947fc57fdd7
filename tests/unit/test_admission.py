import itertools
import random
from collections import deque
from types import SimpleNamespace

import pytest

from pipelinerl import messages as m
from pipelinerl.admission import Admission
from pipelinerl.steps import counts_as_discarded
from pipelinerl.planner.calibration import load_calibration
from pipelinerl.planner.simulation import simulate


def fill(a: Admission) -> int:
    n = 0
    while a.may_start():
        a.on_start()
        n += 1
    return n


def test_pipeline_budget_is_max_lag_steps_of_unconsumed_groups():
    a = Admission(
        groups_per_step=16, generators=1, max_lag=4, max_inflight=1000, training_step=0, weights_version=0
    )  # step 0 training
    assert fill(a) == 64
    for _ in range(16):
        a.on_finish(0, discarded=False)
    assert not a.may_start()  # finished but untrained groups still count
    a.on_trained(16, training_step=1)
    assert not a.may_start()  # the engine still holds version 0: a group started now gets lag 5
    a.on_weights(1, generators=1)
    # 48 groups started on version 0 still run (steps 2-4): one started now could overtake one
    # of them into step 5, at lag 5.
    assert not a.may_start()
    for _ in range(48):
        a.on_finish(0, discarded=False)
    assert fill(a) == 16  # step 5, lag 4


def test_sync_mode_one_step_and_discards_free_budget():
    a = Admission(groups_per_step=4, generators=1, max_lag=0, max_inflight=1000, weights_version=0)
    assert fill(a) == 4
    a.on_finish(0, discarded=True)  # zero-variance: will never be trained
    assert fill(a) == 1  # replaced at once, so a step can always be filled
    a.on_trained(3)
    a.on_trained(2)  # out-of-order announcement is ignored
    assert a.trained == 3


def test_a_group_given_up_before_it_is_published_frees_its_place():
    """A problem whose prompt is too long for model.maxSeqLen is skipped (`PromptTooLong`): its
    group is abandoned, not published, and takes no place in the queue or the phase."""
    a = Admission(groups_per_step=4, generators=1, max_lag=1, max_inflight=1000, training_step=0, weights_version=0)
    assert fill(a) == 4
    a.abandon(0)
    assert fill(a) == 1 and a.published == 0
    sync = Admission(groups_per_step=4, generators=1, max_lag=0, max_inflight=1000, weights_version=0)
    assert fill(sync) == 4
    sync.abandon(0)
    assert sync.phase_groups[0] == 3 and fill(sync) == 1


def test_share_and_inflight_cap():
    a = Admission(groups_per_step=10, generators=3, max_lag=2, max_inflight=5, training_step=0, weights_version=0)
    assert a.share == 4 and a.budget == 8
    assert fill(a) == 5  # capped by concurrency
    a.on_finish(0, False)
    assert fill(a) == 1


def test_one_more_share_once_the_weights_of_the_step_in_training_have_landed():
    a = Admission(groups_per_step=16, generators=1, max_lag=1, max_inflight=1000, weights_version=0)
    # Before any step: step 0 trains version-0 groups (lag 0), step 1 trains them at lag 1.
    assert fill(a) == 32
    for _ in range(32):
        a.on_finish(0, discarded=False)
    a.on_trained(16, training_step=0)  # step 0 starts with the engine at version 0
    assert a.budget == 16 and not a.may_start()  # groups started now land in step 2: lag 2
    a.on_weights(1, generators=1)  # step 0 is over and its weights are in: a group started now lands in step 2 at lag 1
    assert a.budget == 32 and fill(a) == 16
    a.on_trained(16, training_step=0)  # the end-of-step announcement changes nothing
    a.on_trained(32, training_step=1)  # step 1 starts
    assert a.budget == 16 and not a.may_start()  # 16 queued for step 2 already
    a.on_trained(32, training_step=0)  # stale announcements never go backwards
    assert a.training_step == 1


def test_sync_mode_generates_only_on_the_weights_of_the_newest_step_trained():
    a = Admission(groups_per_step=8, generators=1, max_lag=0, max_inflight=1000, weights_version=0)
    assert fill(a) == 8
    for _ in range(8):
        a.on_finish(0, discarded=False)
    a.on_trained(8, training_step=0)  # step 0 trained and announced: the generator still holds version 0
    assert a.budget == 0 and fill(a) == 0  # a group started now would be trained at lag 1
    a.on_weights(1, generators=1)
    assert fill(a) == 8


def test_conventional_k_generates_a_whole_phase_then_waits_for_its_weights():
    # k = 4: a phase of 4 steps is generated on version 0; its steps are announced one by one
    # (each frees its groups), but nothing starts until the weights of step 4 are in.
    a = Admission(
        groups_per_step=4, generators=2, max_lag=3, max_inflight=1000, weights_version=0, steps_per_generation=4
    )
    assert a.share == 2 and fill(a) == 8  # this generator's share of the whole phase
    a.on_finish(0, discarded=True)  # zero-variance: replaced at once, the phase still fills
    assert fill(a) == 1
    for _ in range(8):
        a.on_finish(0, discarded=False)
    for step in range(4):
        a.on_trained(2 * (step + 1), training_step=step)
        assert a.budget == 0 and fill(a) == 0  # mid-phase: the generator holds only version 0
    a.on_weights(4, generators=2)  # the phase's weights
    assert a.budget == 8 and fill(a) == 8


def test_a_phase_overshot_by_generators_that_joined_apart_never_holds_the_next_one_back():
    # Found by benchmark 11 with two engines (k = 4, 16 groups a step): generator 0 joined first
    # and took the whole phase as its share (64), generator 1 joined and started its own share
    # (32) before it heard its peer; the steps took 42 of generator 0's groups and 22 of
    # generator 1's. Counted by the trainer's credits, each queue held 32 groups the next phase
    # could not train (too old: settled only by its first step) against a budget of 32: neither
    # generator started the phase that step needed, and the trainer waited for it forever.
    first = Admission(groups_per_step=16, generators=1, max_lag=3, max_inflight=1000, steps_per_generation=4)
    second = Admission(groups_per_step=16, generators=2, max_lag=3, max_inflight=1000, steps_per_generation=4)
    first.on_weights(0, generators=1)
    assert fill(first) == 64
    first.on_weights(0, generators=2)  # the second joined: the same weights, shared by two
    second.on_weights(0, generators=2)
    assert fill(second) == 32  # it had not heard its peer yet
    for a, started in ((first, 64), (second, 32)):
        for _ in range(started):
            a.on_finish(0, discarded=False)
    first.on_trained(42, training_step=3)
    second.on_trained(22, training_step=3)
    for a in (first, second):
        assert a.budget == 0  # the phase trains
        a.on_weights(4, generators=2)  # its weights: the next phase
        assert a.queued == 0 and fill(a) == 32  # its share of the phase, whatever the last left over


def test_a_group_the_preprocessor_will_dead_letter_holds_no_place_in_a_phase():
    # Its first step waits for the whole phase: had the generator kept counting a group that can
    # never be trained (a reward not finite here) as queued, the phase would wait for it forever.
    spec = SimpleNamespace(rl=SimpleNamespace(filter_zero_variance=True), model=SimpleNamespace(max_seq_len=40))
    a = Admission(groups_per_step=4, generators=1, max_lag=1, max_inflight=9, weights_version=0, steps_per_generation=2)
    assert fill(a) == 8
    sample = m.Sample(tokens=[3, 4], mask=[0, 1], logprobs=[0.0, -0.5], versions=[-1, 0], reward=float("nan"))
    poisoned = m.RolloutGroup(group_id="p1@0", generator=0, samples=[sample, sample])
    a.on_finish(0, discarded=counts_as_discarded(spec, poisoned))  # as the generator publishes it
    assert fill(a) == 1  # replaced at once


def test_one_share_less_while_the_weights_of_the_step_before_are_still_loading():
    # The trainer sends version 1 and starts step 1 before the generator has loaded it: groups
    # started on version 0 now would be trained in step 2, at lag 2.
    a = Admission(groups_per_step=16, generators=1, max_lag=1, max_inflight=1000, weights_version=0)
    assert fill(a) == 32
    for _ in range(32):
        a.on_finish(0, discarded=False)
    a.on_trained(32, training_step=1)  # steps 0 and 1 consumed, the engine still at version 0
    assert a.budget == 0 and not a.may_start()
    a.on_weights(1, generators=1)  # version 1 in: a group started now is trained in step 2 at lag 1
    assert a.budget == 16 and fill(a) == 16
    b = Admission(groups_per_step=16, generators=1, max_lag=2, max_inflight=1000, training_step=1, weights_version=0)
    assert b.budget == 16  # max lag 2: one step of room remains


def test_nothing_starts_before_the_trainer_sent_weights():
    a = Admission(groups_per_step=16, generators=1, max_lag=1, max_inflight=1000)
    assert a.weights_version == -1 and fill(a) == 0  # disk weights carry no version: never sampled from
    a.on_weights(3, generators=1)
    assert fill(a) == 32


def test_share_follows_the_generators_in_the_weight_group():
    # One of two generators died: the survivor's share grows to the whole step, or no step
    # could ever be filled again.
    a = Admission(groups_per_step=16, generators=2, max_lag=1, max_inflight=1000, weights_version=0)
    assert a.share == 8 and fill(a) == 16
    a.on_weights(1, generators=1)
    assert a.share == 16 and fill(a) == 16


def test_a_restarted_generator_counts_its_earlier_incarnations_queued_groups():
    # The first incarnation published 40 groups (4 zero-variance) and died with 8 more running;
    # steps so far trained 20 of them. The restart continues from its books in the stream.
    a = Admission(
        groups_per_step=16,
        generators=1,
        max_lag=1,
        max_inflight=1000,
        weights_version=3,
        training_step=2,
        published=40,
        discarded=4,
        trained=20,
    )
    assert a.queued == 16 and a.budget == 32 and fill(a) == 16  # 16 of the dead one's still to train
    a.on_finish(3, discarded=True)
    assert a.published == 41 and a.discarded == 5 and a.queued == 31  # 16 + the 15 still running


def test_a_rolled_back_trainer_makes_the_queue_look_longer_never_shorter():
    # The trainer resumed from an older checkpoint: its announcements restart lower, which only
    # holds generation back until the replayed steps catch up (never lets it run ahead).
    a = Admission(
        groups_per_step=16,
        generators=1,
        max_lag=1,
        max_inflight=1000,
        weights_version=10,
        training_step=9,
        published=170,
        trained=150,
    )
    restarted = Admission(
        groups_per_step=16,
        generators=1,
        max_lag=1,
        max_inflight=1000,
        weights_version=10,
        training_step=9,
        published=170,
    )
    restarted.on_trained(100, training_step=9)  # the resumed trainer's first announcement
    assert restarted.queued > a.queued
    assert fill(restarted) <= fill(a)


def lags_of_a_run(lengths, max_lag: int, share: int, max_inflight: int, train_ticks: int, steps: int):
    """One generator and a trainer (`lags_of_a_cluster` with one generator): each trained
    group's lag, and the ticks."""
    lags, t = lags_of_a_cluster([lengths], max_lag, share, max_inflight, train_ticks, steps)
    return lags[0], t


def lags_of_a_cluster(
    lengths, max_lag, groups_per_step, max_inflight, train_ticks, steps, hear_peers=True, joins_at=None
):
    """Generators (one `lengths` iterator each) and a trainer, in ticks: groups are generated for
    `lengths` ticks each and consumed in the order they finish, from all generators,
    `groups_per_step` a step; the trainer announces each step as it starts and sends its weights
    when it ends. With `hear_peers` every generator hears the others' queues each tick (their
    hellos). Generator i takes part from step `joins_at[i]` on (the weights it then gets name the
    membership). Returns each generator's trained groups' lags, and the ticks."""
    n = len(lengths)
    joins_at = joins_at or [0] * n
    gens = [Admission(groups_per_step, 1, max_lag, max_inflight) for _ in range(n)]
    running: list[tuple[int, int, int]] = []  # (tick it finishes, generator, weights version it started at)
    done: deque[tuple[int, int]] = deque()  # finished, not yet consumed: (generator, start version)
    lags: list[list[int]] = [[] for _ in range(n)]
    trained = [0] * n
    step, training_until, t = 0, None, 0

    def send_weights() -> None:
        members = [i for i in range(n) if joins_at[i] <= step]
        for i in members:
            gens[i].on_weights(step, generators=len(members))

    send_weights()
    while step < steps:
        for g in sorted(g for g in running if g[0] <= t):
            running.remove(g)
            gens[g[1]].on_finish(g[2], discarded=False)
            done.append((g[1], g[2]))
        if training_until is not None and t >= training_until:
            step, training_until = step + 1, None
            send_weights()
        if training_until is None and len(done) >= groups_per_step:
            for _ in range(groups_per_step):
                i, version = done.popleft()
                lags[i].append(step - version)  # step s trains at version s
                trained[i] += 1
            for i, a in enumerate(gens):
                a.on_trained(trained[i], training_step=step)
            training_until = t + train_ticks
        for i, a in enumerate(gens):
            if hear_peers:
                for j, b in enumerate(gens):
                    if j != i and b.weights_version >= 0:
                        a.on_peer(j, b.queued, min(b.running, default=None), now=t)
            while a.may_start():
                running.append((t + next(lengths[i]), i, a.on_start()))
        t += 1
    return lags, t


def test_a_long_group_overtaken_by_shorter_ones_stays_within_max_lag():
    # Most groups take a tick, every eighth 9 ticks (several steps): the short ones started
    # after a long one finish first and are trained first. Counted from the engine's version,
    # the budget let them queue until the long one came up to 8 versions old.
    lags, ticks = lags_of_a_run(
        itertools.cycle([9] + [1] * 7), max_lag=4, share=4, max_inflight=8, train_ticks=2, steps=200
    )
    assert max(lags) <= 4
    assert ticks < 200 * 2 * 1.3  # and the trainer (2 ticks a step) is still fed most of the time


def test_a_max_lag_shorter_than_the_longest_generation_holds_admission_back_without_deadlock():
    lags, ticks = lags_of_a_run(
        itertools.cycle([12] + [1] * 7), max_lag=2, share=4, max_inflight=8, train_ticks=2, steps=100
    )
    assert max(lags) <= 2 and len(lags) == 400


@pytest.mark.parametrize(
    "mode,max_lag,waves,filtered,k",
    [
        ("pipeline", 1, 0, 0.0, 1),
        ("pipeline", 2, 2, 0.3, 1),
        ("pipeline", 4, 3, 0.1, 1),
        ("sync", 0, 0, 0.3, 1),
        ("sync", 0, 0, 0.3, 2),  # conventional k = 2: a phase of two steps
    ],
)
def test_the_planners_simulation_and_the_generators_admission_agree_on_one_trace(mode, max_lag, waves, filtered, k):
    # The simulation reports what admission hears (group starts and finishes, steps consumed,
    # weights landed) with its budget and queue after each; the generator's Admission, fed the
    # same calls, must reach the same budget and queue at every one.
    trace: list[tuple] = []
    calib = load_calibration("cpu-long-tail")
    simulate(mode, 2, 1, max_lag, 64, 4, calib, 256, steps=10, warmup=2, filtered=filtered,
             wave_groups=waves, seed=3, trace=trace, steps_per_generation=k)  # fmt: skip
    lag = max_lag if mode == "pipeline" else k - 1  # as JobSpec.max_lag says
    a = Admission(groups_per_step=16, generators=1, max_lag=lag, max_inflight=1 << 30, steps_per_generation=k)
    a.on_weights(0, generators=1)
    budgets = set()
    for event, *args, budget, queued in trace:
        if event == "start":
            assert a.may_start() and a.on_start() == args[0]
        elif event == "finish":
            a.on_finish(args[0], discarded=args[1])
        elif event == "trained":
            a.on_trained(args[0], training_step=args[1])
        else:
            a.on_weights(args[0], generators=1)
        assert (a.budget, a.queued) == (budget, queued), (event, args)
        budgets.add(budget)
    kinds = {e[0] for e in trace}
    assert kinds == {"start", "finish", "trained", "weights"} and len(trace) > 200
    assert mode == "sync" or len(budgets) >= 2  # the budget moved with the steps and the oldest group


def random_lengths(seed: int):
    """Mostly one tick, three in ten 2-5 ticks."""
    rng = random.Random(seed)
    while True:
        yield 1 if rng.random() < 0.7 else rng.randint(2, 5)


@pytest.mark.parametrize("max_lag,groups_per_step", [(1, 4), (2, 8), (4, 8)])
def test_generators_that_hear_their_peers_never_push_a_group_past_max_lag(max_lag, groups_per_step):
    # Two generators of the same speed distribution. Steps fill in finish order from both, so a
    # generator counting only its own share is overtaken by the other's short groups: about
    # one group in ten went past max_lag (its tokens dropped). Hearing each other's queues and
    # oldest groups, none does, and at max_lag 4 the run is no slower.
    deaf, deaf_ticks = lags_of_a_cluster(
        [random_lengths(1), random_lengths(2)], max_lag, groups_per_step, 8, 2, 100, hear_peers=False
    )
    heard, ticks = lags_of_a_cluster([random_lengths(1), random_lengths(2)], max_lag, groups_per_step, 8, 2, 100)
    assert sum(lag > max_lag for lags in deaf for lag in lags) > 0.05 * sum(map(len, deaf))
    assert max(lag for lags in heard for lag in lags) <= max_lag
    assert min(map(len, heard)) > 0.4 * sum(map(len, heard))  # both generators feed the steps
    if max_lag == 4:
        assert ticks <= deaf_ticks * 1.02


def test_a_generator_joining_behind_a_peers_backlog_waits_until_its_groups_can_make_their_steps():
    # Generator 1 was gone: generator 0 alone queued two whole steps (lag 1, 4 groups a step).
    # Generator 1 comes back at version 7: a group it started now would be trained after those
    # 8, at step 9, lag 2. It waits until step 7's groups are consumed, then takes its share.
    joining = Admission(
        groups_per_step=4, generators=2, max_lag=1, max_inflight=100, weights_version=7, training_step=6
    )
    joining.on_peer(0, queued=8, oldest=None, now=0.0)
    assert joining.budget == 4 and joining.cluster_room == 0 and not joining.may_start()
    joining.on_trained(0, training_step=7)  # step 7 took 4 of generator 0's
    joining.on_peer(0, queued=4, oldest=None, now=1.0)
    assert fill(joining) == 0  # version 7 still loaded: a group started now would reach step 9
    joining.on_weights(8, generators=2)
    assert fill(joining) == 4  # trained at step 9 at the latest: lag 1
    # A peer whose hellos stopped (dead: its groups in flight are lost) is forgotten.
    joining.expire_peers(now=1.0 + joining.peer_ttl_s + 0.1)
    assert joining.peers == {}


def test_a_peers_old_group_in_flight_holds_this_generators_share():
    # Generator 0 still runs a group started at version 5 while step 6 trains (lag 1 is its
    # limit): every group generator 1 queues now can overtake it into a later step.
    a = Admission(groups_per_step=4, generators=2, max_lag=1, max_inflight=100, weights_version=6, training_step=6)
    assert a.budget == 2
    a.on_peer(0, queued=1, oldest=5, now=0.0)
    assert a.oldest == 5 and a.budget == 0 and not a.may_start()
    a.on_peer(0, queued=1, oldest=None, now=0.5)  # it finished
    assert fill(a) == 2


def test_a_peer_stuck_in_a_weight_update_no_longer_holds_admission():
    # Generator 0's engine stopped answering mid-update, its group started at version 5 with it;
    # the trainer dropped it and sends generator 1 the whole step. Counted as gone, not waited for.
    a = Admission(groups_per_step=4, generators=2, max_lag=1, max_inflight=100, weights_version=6, training_step=6)
    a.on_peer(0, queued=3, oldest=5, now=0.0)
    a.on_weights(7, generators=1)
    assert not a.may_start()  # its old group in flight holds the whole cluster
    a.forget_peer(0)
    assert a.oldest == 7 and fill(a) == 8


@pytest.mark.parametrize(("max_lag", "k"), [(3, 4), (1, 1)])
def test_the_last_weights_start_nothing(max_lag, k):
    """Weights of version maxSteps come after the last step: a group started on them would never
    be trained. In sync mode the final weights land before the trainer's final checkpoint and its
    `finished` announcement, and a whole phase would be generated meanwhile (seen in CI under
    load: the BATCHES stream held a phase past the last step). The control: without the cap the
    same books start groups."""
    books = dict(groups_per_step=4, generators=1, max_lag=max_lag, max_inflight=1000, steps_per_generation=k)
    capped, control = Admission(**books, max_steps=8), Admission(**books)
    for a in (capped, control):
        a.on_weights(8 - k, generators=1)  # the last phase's (or step's) weights
        started = fill(a)
        assert started > 0
        for _ in range(started):
            a.on_finish(8 - k, discarded=False)
        a.on_trained(32, training_step=7)  # every step trained
        a.on_weights(8, generators=1)  # the final weights
    assert fill(control) > 0 and fill(capped) == 0
