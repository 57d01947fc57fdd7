from pipelinerl_generator.admission import Admission


def fill(a: Admission) -> int:
    n = 0
    while a.may_start():
        a.on_start()
        n += 1
    return n


def test_pipeline_budget_is_max_lag_steps_of_unconsumed_groups():
    a = Admission(groups_per_step=16, generators=1, max_lag=4, max_inflight=1000)
    assert fill(a) == 64
    for _ in range(16):
        a.on_finish(discarded=False)
    assert not a.may_start()  # finished but untrained groups still count
    a.on_trained(16)
    assert fill(a) == 16


def test_sync_mode_one_step_and_discards_free_budget():
    a = Admission(groups_per_step=4, generators=1, max_lag=0, max_inflight=1000)
    assert fill(a) == 4
    a.on_finish(discarded=True)  # zero-variance: will never be trained
    assert fill(a) == 1  # replaced at once, so a step can always be filled
    a.on_trained(3)
    a.on_trained(2)  # out-of-order announcement is ignored
    assert a.trained == 3


def test_share_and_inflight_cap():
    a = Admission(groups_per_step=10, generators=3, max_lag=2, max_inflight=5)
    assert a.share == 4 and a.budget == 8
    assert fill(a) == 5  # capped by concurrency
    a.on_finish(False)
    assert fill(a) == 1
