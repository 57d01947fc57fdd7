"""The peer benchmark (bench/peer_trl.py): where each side's step goes, how a ratio reads when a
side misses a target, the rows TRL trains on, and what each side's run is given."""

import json
import math
from pathlib import Path

import pytest
import yaml

from bench.peer_trl import describe, where_time_goes, write_rows
from pipelinerl.spec import parse_job


def trl_step(step: int, t: float) -> dict:
    return {
        "step": step,
        "time": t,
        "seconds": 0.3,
        "generate_seconds": 0.1,
        "reward_seconds": 0.001,
        "score_other_seconds": 0.004,
        "forward_seconds": 0.07,
        "backward_seconds": 0.11,
        "optimizer_other_seconds": 0.015,
        "train_seconds": 0.3,
    }


def our_step(step: int, t: float) -> dict:
    return {
        "step": step,
        "time": t,
        "samples": 128,
        "train_seconds": 0.4,
        "optimizer_seconds": 0.05,
        "weight_sync_seconds": 0.03,
        "groups_filtered": 12,
    }


def test_where_time_goes_splits_a_step_into_its_phases():
    trl = where_time_goes("trl", [{"steps_log": [trl_step(i, 0.3 * i) for i in range(1, 6)]}], 8)
    assert trl == pytest.approx(
        {
            "generate": 0.1,
            "reward": 0.001,
            "score_other": 0.004,
            "forward": 0.07,
            "backward": 0.11,
            "optimizer_other": 0.015,
        }
    )
    ours = where_time_goes(
        "pipeline", [{"steps_log": [our_step(i, 0.5 * i) for i in range(1, 6)], "generator_busy_fraction": 0.9}], 8
    )
    assert ours["period"] == pytest.approx(0.5) and ours["trainer_compute"] == pytest.approx(0.4)
    assert ours["trainer_waits_for_data"] == pytest.approx(0.5 - 0.4 - 0.03)
    assert ours["groups_generated_per_step"] == pytest.approx(128 / 8 + 12)  # trained + filtered groups
    assert ours["generator_busy_fraction"] == 0.9


def test_a_missed_target_reads_as_a_bound_not_a_ratio():
    def run(times_acc):
        steps = [{"step": 1, "time": 1.0, "train_seconds": 1.0}]
        return {
            "steps_log": steps + [{"step": 2, "time": 100.0, "train_seconds": 1.0}],
            "evals": [{"version": 0, "time": 0.0, "accuracy": 0.3}]
            + [{"version": v, "time": t, "accuracy": a} for v, (t, a) in enumerate(times_acc, 1)],
        }

    ours, trl = run([(10, 0.45), (20, 0.55)]), run([(50, 0.35), (100, 0.38)])
    runs = {"pipeline": [ours], "trl": [trl]}
    ci = {"p5": None, "p95": None}
    assert "trl never reached it in its run (> 10.00x)" in describe(
        {"pooled": math.inf, "interval": ci}, runs, "pipeline", "trl", 15
    )
    assert describe({"pooled": 0.0, "interval": ci}, runs, "pipeline", "trl", 15) == "pipeline never reached it"
    assert describe({"pooled": None, "interval": ci}, runs, "pipeline", "trl", 15) == "neither reached it"
    both = {"pooled": 2.5, "interval": {"p5": 2.0, "p95": 3.1}}
    assert describe(both, runs, "pipeline", "trl", 15) == "2.50x (2.00-3.10)"


def test_the_projects_sides_get_every_option_their_shared_run_reads():
    """The pipeline and sync sides run through benchmark 1's `one_run`: every `args.X` it reads
    must be set by the peer benchmark's options (a missing one failed the first pipeline round,
    after the sweep, once `--sync-cores` was added there)."""
    import ast
    import inspect

    from bench.peer_trl import parse_args
    from bench.pipeline_vs_sync import one_run

    tree = ast.parse(inspect.getsource(one_run))
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args"
    }
    assert {"sync_cores", "eval_problems", "steps"} <= read  # the walk sees what one_run reads
    assert read <= set(vars(parse_args([]))), read - set(vars(parse_args([])))


def test_a_trl_k_side_asks_trl_for_k_steps_per_generation(tmp_path, monkeypatch):
    """`trl-k4` passes steps_per_generation 4 to TRL's config; the other TRL sides do not."""
    import subprocess

    from bench import peer_trl

    seen = {}

    def fake_run(cmd, **_):  # records TRL's command line; the run itself is bench/trl_grpo.py's
        seen[Path(cmd[cmd.index("--out") + 1]).name] = cmd
        raise SystemExit("stop here")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(peer_trl, "trl_python", lambda: tmp_path / "python")  # no environment made
    args = peer_trl.parse_args(["--trl-steps", "5"])
    for side in ("trl", "trl-parity", "trl-k4"):
        with pytest.raises(SystemExit):
            peer_trl.trl_run(args, "0", tmp_path, side=side)
    sets = {out: [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"] for out, cmd in seen.items()}
    assert sets == {"trl-0": [], "trl-parity-0": peer_trl.PARITY, "trl-k4-0": ["steps_per_generation=4"]}


def test_trl_trains_on_the_jobs_training_stream_as_prompt_answer_rows(tmp_path):
    from pipelinerl.tasks import make_task

    job = parse_job(yaml.safe_load(open("examples/long-tail-cpu.yaml")))
    write_rows(job, 50, tmp_path / "rows.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    task = make_task("chain", job.spec.task.params)
    assert len(rows) == 50
    assert rows[7] == {"prompt": task.train_problem(7).prompt, "answer": task.train_problem(7).answer}


def test_reanalysis_pools_the_rounds_of_several_files(tmp_path):
    from bench.common import pooled_runs

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": {"pipeline": [{"r": 0}], "trl": [{"r": 0}]}}))
    b.write_text(json.dumps({"runs": {"pipeline": [{"r": 1}], "sync": [{"r": 1}], "trl": [{"r": 1}]}}))
    assert pooled_runs([a, b], ["pipeline", "sync"])[0] == {"pipeline": [{"r": 0}, {"r": 1}], "sync": [{"r": 1}]}
    # none of sync:
    assert pooled_runs([a], ["pipeline", "sync", "trl"])[0] == {"pipeline": [{"r": 0}], "trl": [{"r": 0}]}


def test_reanalysis_pools_rounds_of_one_kind_of_machine_only(tmp_path):
    """Two "AMD EPYC" VMs of different generations, or whose torch kernels differ, are two
    machines; a record that does not say (an older one) is not held to it."""
    from bench.common import pooled_runs

    def saved(name: str, **machine) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"machine": {"cpu": "AMD EPYC", "cpus": 2} | machine, "runs": {"pipeline": [{}]}}))
        return path

    avx2, avx512, older = saved("a", cpu_capability="AVX2"), saved("b", cpu_capability="AVX512"), saved("c")
    with pytest.raises(SystemExit, match=r"b.json on 'AVX512': rounds of different machines"):
        pooled_runs([avx2, avx512], ["pipeline"])
    runs, ran_on = pooled_runs([avx2, older], ["pipeline"])
    assert len(runs["pipeline"]) == 2 and ran_on["cpu_capability"] == "AVX2"  # as the record saying it
    zen1, zen2 = saved("e", cpu_generation="family 23 model 1"), saved("f", cpu_generation="family 23 model 49")
    with pytest.raises(SystemExit, match="cpu_generation"):
        pooled_runs([zen1, zen2], ["pipeline"])
    with pytest.raises(SystemExit, match="cpus"):
        pooled_runs([older, saved("d", cpus=16)], ["pipeline"])
