"""Pure accounting of the local runner and the trainer step: core pinning, busy clocks,
throughput over the steady window, per-lag token counts, samples dropped for lag."""

import math
import time
from pathlib import Path

import pytest
import torch

from pipelinerl import messages as m
from pipelinerl_cli.local import LocalRun, Running
from pipelinerl_cli.supervisor import Cores, core_plan
from pipelinerl.spec import load_job
from pipelinerl_generator.metrics import BusyClock
from pipelinerl_trainer.loss import LossConfig
from pipelinerl_trainer.step import StepConfig, StepTally, micro_batch_loss

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def test_split_cores_give_each_process_its_own_cores_and_as_many_threads():
    plan = core_plan("split", [0, 1, 2, 3, 4], trainers=2, generators=1)
    assert plan == {
        ("generator", 0): Cores([0], 1),
        ("trainer", 0): Cores([1, 3], 2),
        ("trainer", 1): Cores([2, 4], 2),
    }
    used = [c for cores in plan.values() for c in cores.cpus or []]
    assert len(used) == len(set(used)) and not any(c.passive for c in plan.values())


def test_split_cores_refuse_too_few_cores():
    with pytest.raises(ValueError, match="needs a core per trainer rank and generator"):
        core_plan("split", [0, 1], trainers=2, generators=1)


def test_colocated_cores_give_the_trainer_and_the_generators_every_core_each():
    plan = core_plan("colocated", [0, 1], trainers=1, generators=1)
    assert plan == {("trainer", 0): Cores(None, 2), ("generator", 0): Cores(None, 2)}
    two = core_plan("colocated", [0, 1, 2, 3], trainers=2, generators=2)
    assert {c.threads for c in two.values()} == {2} and all(c.cpus is None for c in two.values())
    assert not any(c.passive for c in [*plan.values(), *two.values()])  # the phases alternate: never both at once
    default = core_plan("default", [0, 1], trainers=1, generators=1)
    # Both stages at once on the same cores: idle threads sleep rather than spin.
    assert default == {("trainer", 0): Cores(None, 2, True), ("generator", 0): Cores(None, 1, True)}
    with pytest.raises(ValueError, match="cores: one of default, split, colocated"):
        core_plan("shared", [0, 1], trainers=1, generators=1)


def test_busy_clock_counts_overlapping_work_once():
    clock = BusyClock()
    clock.enter()
    clock.enter()  # a second group while the first runs
    time.sleep(0.05)
    clock.leave()
    clock.leave()
    busy = clock.seconds()
    time.sleep(0.05)  # idle: not counted
    assert 0.04 < busy < 0.09
    assert clock.seconds() == busy


def test_generator_counters_summed_across_a_restart_never_go_back():
    # A generator's token and busy counters start again from 0 when it restarts: the runner's
    # totals (its tok/s and busy fraction) showed -184 tok/s right after one, before this.
    tokens = Running()
    tokens.add(("generator-0", 100), 500)
    tokens.add(("generator-1", 101), 300)
    tokens.add(("generator-0", 100), 700)
    assert tokens.total == 1000
    tokens.add(("generator-1", 205), 40)  # restarted: a new process, counting from 0
    assert tokens.total == 1040
    tokens.add(("generator-0", 100), 700)  # nothing new
    tokens.add(("generator-1", 205), 90)
    assert tokens.total == 1090


def test_step_tally_counts_tokens_per_lag():
    tally = StepTally(max_lag=4)
    values = torch.zeros(8, dtype=torch.float64)
    values[1] = 4  # tokens
    tally.add_device(values, torch.tensor([1.0, 2, 0, 1, 0], dtype=torch.float64))  # lags 0, 1, 1, 3
    metrics = tally.metrics()
    assert {k: v for k, v in metrics.items() if k.startswith("tokens_lag_")} == {
        "tokens_lag_0": 1,
        "tokens_lag_1": 2,
        "tokens_lag_3": 1,
    }
    assert metrics["lag_max"] == 3.0 and metrics["lag_mean"] == pytest.approx(1.25)


def test_samples_over_the_lag_budget_are_dropped_and_left_out_of_the_lag_metrics():
    def model(input_ids, position_ids, packing, temperature):  # uniform over 5 tokens
        n = input_ids.shape[1]
        return torch.full((n,), -math.log(5), requires_grad=True), torch.full((n,), math.log(5))

    # Two packed samples of 3 tokens (prompt token, 2 completion tokens) trained at version 5:
    # the first sampled at versions 4 (lag 1), the second at 2 (lag 3 > max lag 2).
    mb = m.MicroBatch(
        step=0,
        rank=0,
        index=0,
        last=True,
        tokens=[1, 2, 3, 1, 4, 2],
        positions=[0, 1, 2] * 2,
        mask=[0, 1, 1] * 2,
        advantages=[0.0, 1.0, 1.0, 0.0, -1.0, -1.0],
        logprobs=[0.0] + [-1.6] * 2 + [0.0] + [-1.6] * 2,
        versions=[4, 4, 4, 2, 2, 2],
        weights=[0.0, 0.5, 0.5, 0.0, 0.5, 0.5],
        lengths=[3, 3],
        rewards=[1.0, 0.0],
    )
    tally = StepTally(max_lag=2)
    micro_batch_loss(model, mb, 5, StepConfig(LossConfig("reinforce"), 1.0, max_lag=2), tally)
    metrics = tally.metrics()
    assert metrics["dropped_for_lag"] == 1 and metrics["tokens"] == 2
    assert metrics["lag_max"] == 1.0 and metrics["tokens_lag_1"] == 2 and "tokens_lag_3" not in metrics


def test_throughput_uses_the_steady_window(tmp_path):
    run = LocalRun(load_job(EXAMPLE), tmp_path, quiet=True)
    # Step 1 ends at t=10 after a long start-up; steps 2-3 take 2 s each, 1.5 s of it training.
    run.train = [
        {
            "step": i,
            "time": t,
            "samples": 128,
            "tokens": 640,
            "train_seconds": 1.4,
            "weight_sync_seconds": 0.1,
            "tokens_lag_0": 10,
            "tokens_lag_1": 5 * (i > 1),
        }
        for i, t in ((1, 10.0), (2, 12.0), (3, 14.0))
    ]
    run.busy = [(5.0, 0.0, 0), (10.0, 1.0, 900), (12.0, 2.8, 2000), (14.0, 4.6, 3300)]
    out = run.throughput()
    assert out["samples_per_second"] == pytest.approx(256 / 4)
    assert out["seconds_per_step"] == pytest.approx(2.0)
    assert out["trainer_busy_fraction"] == pytest.approx(3.0 / 4)
    assert out["generator_busy_fraction"] == pytest.approx(3.6 / 4)
    assert out["lag_token_counts"] == {"0": 30, "1": 10}
    assert out["generated_tokens_per_second"] == pytest.approx(2400 / 4)
    # a step a phase (the pipeline): each waited 2 - 1.4 - 0.1 s for its data
    assert out["phases"]["phases"] == 2 and out["phases"]["wait_seconds"] == pytest.approx(0.5)


def test_a_row_the_disk_takes_in_part_is_cut_off_so_the_file_holds_whole_rows(tmp_path, capsys):
    """A full disk can take the first part of a row (the room left in its last block): the row is
    cut off, or a run resumed in the same folder would glue its next row onto it, and the whole
    file would no longer read (`plan --calibrate-from`)."""
    import json

    run = LocalRun(load_job(EXAMPLE), tmp_path)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 0}\n')

    class FillsUp:
        def __init__(self) -> None:
            self.file = open(path, "a")
            self.name = str(path)

        def fileno(self) -> int:
            return self.file.fileno()

        def write(self, text: str) -> int:
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            self.file.flush()

        def close(self) -> None:
            self.file.close()

    run.metrics_file = FillsUp()  # type: ignore[assignment]
    values = {"step": 1, "reward": 0.5, "loss": 0.1, "lag_max": 0, "ess": 1, "samples": 16, "tokens": 64}
    run.take_metric(m.Metrics(source="trainer-0", kind="train", values=values, timestamp=time.time()))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"kind": "train", "step": 0}]
    assert run.metrics_unwritten == 1 and run.metrics_file is None


def test_a_full_disk_costs_the_run_its_services_record_not_the_run(tmp_path, capsys):
    run = LocalRun(load_job(EXAMPLE), tmp_path)
    (tmp_path / "services.json.tmp").symlink_to("/dev/full")  # the whole-file write's first step
    run._record_services()
    run._record_services()
    said = capsys.readouterr().out
    assert said.count(f"{tmp_path / 'services.json'} not written (No space left on device)") == 1


def test_a_full_disk_costs_the_run_its_metrics_files_rows_not_the_rows(tmp_path, capsys):
    """metrics.jsonl on a full disk (/dev/full: every write ENOSPC): each row is still kept for
    the summary and the plot, counted, and the run told once; nothing raises into the NATS
    callback that delivers the rows."""
    run = LocalRun(load_job(EXAMPLE), tmp_path)
    run.metrics_file = open("/dev/full", "a")
    for step in (1, 2):
        values = {"step": step, "reward": 0.5, "loss": 0.1, "lag_max": 0, "ess": 1, "samples": 16, "tokens": 64}
        values |= {"train_seconds": 1.0, "dropped_for_lag": 0}
        run.take_metric(m.Metrics(source="trainer-0", kind="train", values=values, timestamp=time.time()))
    assert [t["step"] for t in run.train] == [1, 2] and run.metrics_unwritten == 2
    assert capsys.readouterr().out.count("metrics.jsonl takes no more rows (No space left on device)") == 1
    summary = run.summary()
    assert summary["metrics_rows_unwritten"] == 2
    (tmp_path / "summary.json.tmp").symlink_to("/dev/full")  # the whole-file write's first step
    plot, unwritten = run.write_summary(summary)
    assert (
        plot is None
        and unwritten.startswith(f"{tmp_path / 'summary.json'}: No space left on device")
        and not (tmp_path / "summary.json").exists()
    )


def test_a_resumed_run_reads_the_metrics_stream_on_after_the_last_row_written():
    """Rows published after the earlier runner stopped reading (the trainer's step in progress as
    it stopped) are read by the next; a folder with no sequence recorded, or a stream made again
    since (behind the rows), reads only what comes from now on."""
    from pipelinerl_cli.local import first_unread

    rows = [{"kind": "train", "step": 1, "seq": 4}, {"kind": "eval", "seq": 7}, {"oops": 1}]
    assert first_unread(rows, last_seq=9) == 8  # 8 and 9 came after the earlier runner stopped
    assert first_unread(rows, last_seq=7) == 8  # nothing since
    assert first_unread(rows, last_seq=3) == 4  # the stream made again: from now on
    assert first_unread([{"kind": "train", "step": 1}], last_seq=9) == 10  # an older folder's rows
    assert first_unread([], last_seq=0) == 1


def test_a_rejected_sample_is_packed_but_counted_neither_trained_nor_in_the_reward():
    """The trainer blanks a sample the model cannot take (`checks.without`) and trains the rest of
    its row: the step's samples and reward are the others'. Before, the blanked sample counted as
    trained (and its reward in `reward_trained`) as well as rejected."""
    from pipelinerl_trainer.checks import without

    def model(input_ids, position_ids, packing, temperature):
        n = input_ids.shape[1]
        return torch.full((n,), -math.log(5), requires_grad=True), torch.full((n,), math.log(5))

    mb = m.MicroBatch(
        step=0, rank=0, index=0, last=True, tokens=[1, 2, 3, 1, 4, 999], positions=[0, 1, 2] * 2,
        mask=[0, 1, 1] * 2, advantages=[0.0, 1.0, 1.0, 0.0, -1.0, -1.0], logprobs=[0.0, -1.6, -1.6] * 2,
        versions=[4, 4, 4, 4, 4, 4], weights=[0.0, 0.5, 0.5] * 2, lengths=[3, 3], rewards=[0.25, 1.0],
    )  # fmt: skip
    tally = StepTally(max_lag=2)
    tally.add(rejected=1)  # as `Trainer._reject` counts it
    micro_batch_loss(model, without(mb, {1}), 5, StepConfig(LossConfig("reinforce"), 1.0, max_lag=2), tally)
    metrics = tally.metrics()
    assert (metrics["samples"], metrics["samples_rejected"], metrics["tokens"]) == (1, 1, 2)
    assert metrics["reward_trained"] == 0.25


def test_steps_a_restarted_trainer_trains_again_count_once(tmp_path):
    """The trainer killed past its step-2 checkpoint trains steps 3 and 4 again: the summary
    counts each step's newest row (before, samples and drops of steps 3-4 counted twice)."""
    run = LocalRun(load_job(EXAMPLE), tmp_path, quiet=True)
    for step, t, dropped in [(1, 1, 0), (2, 2, 0), (3, 3, 5), (4, 4, 5), (3, 8, 1), (4, 9, 1), (5, 10, 0)]:
        values = {"step": step, "samples": 16, "dropped_for_lag": dropped}
        run.take_metric(m.Metrics(source="trainer", kind="train", values=values, timestamp=run.t0 + t))
    assert [(r["step"], r["time"]) for r in run.train] == [(1, 1), (2, 2), (3, 8), (4, 9), (5, 10)]
    assert sum(r["dropped_for_lag"] for r in run.train) == 2
