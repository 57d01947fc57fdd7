"""Alarms over the newest steps (pure): learning stopped, most samples dropped, a bad loss."""

import math

from pipelinerl.learning import learning_alarm


def step(n: int, tokens: int = 500, samples: int = 128, dropped: int = 0, loss: float = 0.1, **more) -> dict:
    return {"step": n, "tokens": tokens, "samples": samples, "dropped_for_lag": dropped, "loss": loss, **more}


def test_a_healthy_run_raises_nothing():
    assert learning_alarm([]) is None
    assert learning_alarm([step(i, dropped=10) for i in range(1, 30)]) is None


def test_steps_that_train_nothing_are_named_with_the_cause():
    rows = [step(i) for i in range(1, 19)] + [step(i, tokens=0, dropped=128) for i in range(19, 23)]
    assert (
        learning_alarm(rows) == "NoTokensTrained: step(s) 19–22 trained no tokens (512 samples dropped for lag, "
        "0 samples rejected)"
    )
    rows.append(step(23))
    assert learning_alarm(rows) is None  # learning again: the alarm clears
    assert "step(s) 5 trained" in learning_alarm([step(5, tokens=0, samples_rejected=2)])


def test_most_samples_dropped_over_the_window():
    rows = [step(i) for i in range(1, 5)] + [step(i, dropped=100) for i in range(5, 12)]
    assert learning_alarm(rows).startswith("MostSamplesDropped: 700 of the 1280 samples of steps 2–11")
    assert learning_alarm(rows[:-3]) is None  # 400 of 1024


def test_a_non_finite_loss_in_the_window():
    rows = [step(i) for i in range(1, 12)]
    rows[6]["loss"] = math.nan
    assert learning_alarm(rows) == "NonFiniteLoss: the loss of step(s) 7 is not finite"
    assert learning_alarm(rows + [step(i) for i in range(12, 18)]) is None  # out of the window


def test_groups_dropped_before_packing_count_as_dropped():
    rows = [
        step(i, samples=64, dropped=80, samples_stale=64) for i in range(1, 11)
    ]  # half the groups stale, 16 more late
    assert learning_alarm(rows).startswith("MostSamplesDropped: 800 of the 1280 samples")


def test_a_window_of_skipped_updates_is_no_learning_a_few_are_not():
    """fp16's loss scale skips a few steps as it falls at a start (and a bf16 step of non-finite
    gradients is skipped alone): only a whole window of updates skipped raises the alarm."""
    rows = [step(i) for i in range(1, 4)] + [step(i, step_skipped=1) for i in range(4, 13)]
    assert learning_alarm(rows) is None
    rows.append(step(13, step_skipped=1))
    assert learning_alarm(rows) == (
        "StepsSkipped: the optimizer applied no update at steps 4–13 (their gradients were not finite)"
    )
    assert learning_alarm(rows + [step(14)]) is None
