"""The step rules every component shares (pipelinerl.steps), one statement each."""

from types import SimpleNamespace

from pipelinerl import messages as m
from pipelinerl.steps import (
    counts_as_discarded,
    generator_of_rank,
    hopelessly_stale,
    newest_weights,
    next_wave,
    sends_weights,
    step_version,
    steps_left_in_phase,
    token_lag,
    too_old,
    training_step,
    version_after,
    weight_group_rank,
    weight_group_size,
)


def test_the_weight_groups_ranks_name_their_generator():
    # Trainer rank 0; generator i's workers (tensor-parallel engines) follow in membership order.
    for tp in (1, 2, 4):
        ranks = [weight_group_rank(i, tp) + w for i in range(3) for w in range(tp)]
        assert ranks == list(range(1, weight_group_size(3, tp)))
        assert [generator_of_rank(r, tp) for r in ranks] == [i for i in range(3) for _ in range(tp)]


def test_steps_and_versions_count_alike_everywhere():
    # Step N trains at version N (the steps taken before it) and makes version N + 1.
    assert [step_version(n) for n in range(3)] == [0, 1, 2] and version_after(4) == 5
    assert newest_weights(6) == 7  # version 7 may be sent, and sampled from, before it is announced
    # A token sampled at version 3 and trained by step 5 is 2 versions old: past maxLag 1, not 2.
    assert token_lag(step_version(5), 3) == 2 and too_old(2, 1) and not too_old(2, 2)


def test_a_group_too_old_for_the_step_it_can_go_into_is_hopelessly_stale():
    def sample(versions):
        return m.Sample(tokens=[3, 4, 5, 6], mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1], versions=versions, reward=1)

    g = m.RolloutGroup(group_id="p1@0", generator=0, samples=[sample([-1, -1, 2, 3]), sample([-1, -1, 1, 1])])
    assert not hopelessly_stale(g, step=4, max_lag=1)  # its newest tokens (version 3) are trained at lag 1
    assert hopelessly_stale(g, step=5, max_lag=1)  # nothing left the trainer would keep
    assert not hopelessly_stale(g, step=5, max_lag=2)
    assert not hopelessly_stale(g, step=3, max_lag=0) and hopelessly_stale(g, step=4, max_lag=0)  # sync


def test_an_announcement_names_the_step_in_training():
    assert training_step(m.PolicyVersion(version=7, training=True, timestamp=0)) == 7  # step 7 has started
    assert training_step(m.PolicyVersion(version=7, timestamp=0)) == 6  # the weights step 6 made


def group(*rewards: float, versions: tuple[int, int] = (-1, 0)) -> m.RolloutGroup:
    sample = dict(tokens=[3, 4], mask=[0, 1], logprobs=[0.0, -0.5], versions=list(versions))
    return m.RolloutGroup(group_id="p1@0", generator=0, samples=[m.Sample(**sample, reward=r) for r in rewards])


def test_a_group_is_discarded_where_the_job_filters_zero_variance_or_it_cannot_be_trained():
    spec = SimpleNamespace(rl=SimpleNamespace(filter_zero_variance=True), model=SimpleNamespace(max_seq_len=8))
    kept = SimpleNamespace(rl=SimpleNamespace(filter_zero_variance=False), model=spec.model)
    assert counts_as_discarded(spec, group(1.0, 1.0)) and not counts_as_discarded(kept, group(1.0, 1.0))
    assert not counts_as_discarded(spec, group(1.0, 0.0))
    # The preprocessor dead-letters it (a reward not finite): its generator must not wait for it.
    assert counts_as_discarded(kept, group(1.0, float("nan")))
    # Whether a version is ahead of the trainer only the preprocessor can tell: not discarded here.
    assert not counts_as_discarded(kept, group(1.0, 0.0, versions=(-1, 10**6)))


def test_a_generation_phase_of_k_steps_gets_the_weights_once_at_its_end():
    assert [steps_left_in_phase(s, 4) for s in range(9)] == [4, 3, 2, 1, 4, 3, 2, 1, 4]
    assert [steps_left_in_phase(s, 1) for s in range(3)] == [1, 1, 1]  # pipeline mode: every step
    # Versions 0 (the start), 4, 8: each phase's end; and the last step's, wherever it falls.
    assert [v for v in range(11) if sends_weights(v, 4, last=False)] == [0, 4, 8]
    assert sends_weights(10, 4, last=True)
    assert all(sends_weights(v, 1, last=False) for v in range(5))


def test_the_conventional_baseline_publishes_a_phase_only_once_it_is_generated_whole():
    groups = [[5, 5]] * 11  # 11 groups of two samples
    args = dict(groups_per_step=4, ranks=1, micro_batch_tokens=64, stream=False)
    assert next_wave(groups, 0, steps_left=3, **args) == (0, False)  # 11 < 3 steps of 4 groups
    assert next_wave(groups + [[5, 5]], 0, steps_left=3, **args) == (4, True)
    assert next_wave(groups[:8], 0, steps_left=2, **args) == (4, True)  # mid-phase: the rest is there
    assert next_wave(groups[:3], 1, steps_left=1, **args) == (3, True)  # a step left partial: its rest
