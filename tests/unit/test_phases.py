"""Where a run's time went (pure): phases of k steps from the trainer's rows."""

import pytest

from pipelinerl.phases import decomposition, phases


def conventional(k: int, n_phases: int, gen_s: float, train_s: float, update_s: float, tokens: int = 100) -> list:
    """The rows a conventional run writes: each phase generated in `gen_s`, then k steps of
    `train_s` each, the last of them sending the weights in `update_s`; start-up 30 s."""
    rows, t = [], 30.0
    for p in range(n_phases):
        t += gen_s
        for j in range(1, k + 1):
            update = update_s if j == k else 0.0
            t += train_s + update
            rows.append(
                {
                    "step": p * k + j,
                    "time": t,
                    "samples": 8,
                    "tokens": tokens,
                    "train_seconds": train_s,
                    "weight_sync_seconds": update,
                }
            )
    return rows


def test_a_conventional_phase_is_its_generation_then_k_steps_then_one_update():
    ps = phases(conventional(4, 5, gen_s=10.0, train_s=2.0, update_s=0.5), 4)
    assert len(ps) == 4  # the first phase holds the start-up: left out
    for p in ps:
        assert (p.steps, p.samples, p.tokens) == (4, 32, 400)
        assert p.span_s == pytest.approx(10 + 4 * 2 + 0.5)
        assert p.wait_s == pytest.approx(10.0) and p.update_s == 0.5 and p.train_s == 8.0


def test_the_decomposition_gives_shares_and_the_generation_rate():
    d = decomposition(conventional(2, 6, gen_s=6.0, train_s=1.5, update_s=1.0), 2)
    assert d["phases"] == 5 and d["steps_per_phase"] == 2
    assert d["wait_seconds"] == pytest.approx(6.0) and d["train_seconds"] == pytest.approx(3.0)
    assert d["wait_share"] + d["train_share"] + d["update_share"] == pytest.approx(1.0)
    assert d["wait_share"] == pytest.approx(6 / 10)
    assert d["tokens_per_wait_second"] == pytest.approx(200 / 6.0)


def test_a_pipeline_step_is_a_phase_and_its_wait_is_starvation():
    rows = conventional(1, 5, gen_s=0.0, train_s=2.0, update_s=0.2)
    d = decomposition(rows, 1)
    assert (
        d["phases"] == 4 and d["wait_seconds"] == pytest.approx(0.0, abs=1e-9) and d["tokens_per_wait_second"] is None
    )


def test_a_phase_cut_short_by_the_end_and_a_replayed_step_count_once():
    rows = conventional(4, 3, gen_s=10.0, train_s=2.0, update_s=0.5)[:-2]  # the last phase: 2 steps of 4
    rows.insert(3, {**rows[2], "time": rows[2]["time"] - 1})  # step 3 replayed after a restart: its newest row
    ps = phases(rows, 4)
    assert [p.steps for p in ps] == [4, 2]
    assert decomposition(rows[:4], 4) is None  # one phase: the start-up's
