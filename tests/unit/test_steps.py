"""The step rules every component shares (pipelinerl.steps), one statement each."""

from types import SimpleNamespace

from pipelinerl import messages as m
from pipelinerl.steps import counts_as_discarded, generator_of_rank, training_step, weight_group_rank, weight_group_size


def test_the_weight_groups_ranks_name_their_generator():
    # Trainer rank 0; generator i's workers (tensor-parallel engines) follow in membership order.
    for tp in (1, 2, 4):
        ranks = [weight_group_rank(i, tp) + w for i in range(3) for w in range(tp)]
        assert ranks == list(range(1, weight_group_size(3, tp)))
        assert [generator_of_rank(r, tp) for r in ranks] == [i for i in range(3) for _ in range(tp)]


def test_an_announcement_names_the_step_in_training():
    assert training_step(m.PolicyVersion(version=7, training=True, timestamp=0)) == 7  # step 7 has started
    assert training_step(m.PolicyVersion(version=7, timestamp=0)) == 6  # the weights step 6 made


def test_a_zero_variance_group_is_discarded_only_where_the_job_filters_them():
    flat, mixed = SimpleNamespace(zero_variance=True), SimpleNamespace(zero_variance=False)
    assert counts_as_discarded(True, flat) and not counts_as_discarded(False, flat)
    assert not counts_as_discarded(True, mixed)
