"""The benchmarks' method (bench/analysis.py, bench/common.py, bench/contention.py): independent
rounds, a band-median headline with a bootstrap over rounds, three clocks, a learning-rate
sweep per side, and a contention guard that reruns a round run beside other programs."""

import argparse
import json
import math
import re
import subprocess
import sys
import time

import pytest

import bench.common as common
from bench import contention
from bench.analysis import (
    band_headline,
    best_setting,
    curve,
    early_targets,
    evaluation_spread,
    log_t_interval,
    round_bound,
    round_seed,
    rounds_to_resolve,
    round_ratio,
    time_to_target,
)


def run(warm, points, origins=None, train_start=0.0):
    """A run whose held-out accuracy reaches `points` ((time, accuracy) on the rows' clock)."""
    return {
        "steps_log": [{"time": train_start + 1.0, "train_seconds": 1.0}],
        "evals": [{"version": 0, "time": 0.0, "accuracy": warm}]
        + [{"version": 10 * (i + 1), "time": t, "accuracy": a} for i, (t, a) in enumerate(points)],
        "clock_origins": origins or {"launch": -20.0, "first_token": -5.0},
    }


def linear(warm, seconds_per_point, until=60.0, every=1.0, offset=0.0):
    """Accuracy rising one point per `seconds_per_point` from the start of training."""
    ts = [every * (i + 1) for i in range(int(until / every))]
    return run(warm, [(t + offset, warm + t / seconds_per_point / 100) for t in ts], train_start=offset)


def test_each_clock_counts_from_its_own_origin():
    x = run(0.3, [(10, 0.4), (20, 0.5)], origins={"launch": -20.0, "first_token": -5.0})
    # training began at 0, on the warm start's weights
    assert curve(x, "time") == [(0.0, 0.3), (10.0, 0.4), (20.0, 0.5)]
    assert curve(x, "first_token") == [(5.0, 0.3), (15.0, 0.4), (25.0, 0.5)]
    assert curve(x, "launch") == [(20.0, 0.3), (30.0, 0.4), (40.0, 0.5)]
    assert time_to_target([x], 10, "launch") == pytest.approx(30.0)
    with pytest.raises(SystemExit, match="no 'launch' clock"):
        curve({k: v for k, v in x.items() if k != "clock_origins"}, "launch")


def test_a_rounds_ratio_and_its_misses_censored_at_the_runs_end():
    fast, slow = linear(0.3, 1.0), linear(0.3, 2.0)  # +10 points at 10 s and at 20 s; both end at 60 s
    assert round_bound(fast, slow, 10) == (pytest.approx(2.0), "exact")
    # Only the baseline misses +40 (its run ends at +30, at 60 s): the ratio is at least 60 / 40.
    assert round_bound(fast, slow, 40) == (pytest.approx(1.5), "at least")
    assert round_bound(slow, fast, 40) == (pytest.approx(40 / 60), "at most")
    assert round_bound(slow, slow, 70) == (None, "missed")


def test_a_round_that_misses_most_targets_enters_the_estimate_at_its_bound():
    # Round 3's baseline stops at +8: its +9 and +10 are censored (ratio at least 16 / 9 and 16 / 10),
    # not a void interval.
    fast = [linear(0.3, 1.0) for _ in range(3)]
    base = [linear(0.3, 2.0), linear(0.3, 2.0), linear(0.3, 2.0, until=16.0)]
    h = band_headline(fast, base, [5, 6, 7, 8, 9, 10])
    assert h["censored"] == 2 and h["geomean"] is not None and h["low"] is not None
    assert h["per_round"][2] == pytest.approx(2.0)  # the median of 2, 2, 2, 2, 1.78, 1.6


def test_the_headline_is_the_band_median_of_per_round_ratios_not_a_pooled_curve():
    # Three independent rounds: the baseline is 2x, 3x and 4x slower. A pooled curve would mix
    # them; the headline is the median of the per-round ratios over the band of targets.
    fast = [linear(0.3, 1.0) for _ in range(3)]
    base = [linear(0.3, k) for k in (2.0, 3.0, 4.0)]
    h = band_headline(fast, base, [5, 6, 7, 8, 9, 10])
    assert h["per_round"] == pytest.approx([2.0, 3.0, 4.0])
    assert h["median"] == pytest.approx(3.0)
    # The interval is a t-interval of the per-round values (on their logs): it contains each
    # round's own value here, and is wide with three rounds, as it should be.
    assert h["geomean"] == pytest.approx(24 ** (1 / 3))
    assert h["low"] < 2.0 and h["high"] > 4.0
    assert h["rounds"] == 3 and h["both_missed"] == 0 and h["per_round_by_gain"]["+5"] == pytest.approx([2, 3, 4])
    assert h["early"] == 0  # every run evaluated every second: every target resolved by an evaluation


def test_the_interval_narrows_with_rounds_and_is_none_when_a_round_is_unbounded():
    five = log_t_interval([2.9, 3.0, 3.1, 3.0, 2.95])
    assert five["low"] < 3.0 < five["high"] and five["high"] / five["low"] < 1.1
    wide = log_t_interval([2.0, 4.0])
    assert wide["high"] / wide["low"] > 10  # two rounds say little
    assert log_t_interval([2.0, math.inf, 3.0])["low"] is None
    assert log_t_interval([3.0])["low"] is None


def test_targets_reached_before_the_first_evaluation_are_counted():
    # Evaluated first at 20 s: +5 and +10 (at 5 s and 10 s) come from the warm start's interpolation.
    x = linear(0.3, 1.0, until=60.0, every=20.0)
    assert early_targets(x, [5, 10, 15, 25]) == [5, 10, 15]
    assert band_headline([x], [x], [5, 10, 25])["early"] == 4  # both sides' +5 and +10


def test_one_target_far_off_does_not_move_the_headline():
    # The baseline learns at half the speed but stalls just before +10 for a long while: at that
    # one target the ratio is 10x, at the band's others 2x. The headline stays 2x.
    fast = linear(0.3, 1.0)
    stall = [(2.0 * t, 0.3 + t / 100) for t in range(1, 10)] + [(100.0, 0.40), (102.0, 0.41), (104.0, 0.42)]
    base = run(0.3, stall)
    assert round_bound(fast, base, 10)[0] == pytest.approx(10.0)
    assert band_headline([fast], [base], [5, 6, 7, 8, 9, 10])["median"] == pytest.approx(2.0)


def test_the_rounds_a_ratio_needs_grow_with_the_spread():
    tight = rounds_to_resolve([1.30, 1.25, 1.35, 1.28, 1.32])
    loose = rounds_to_resolve([0.8, 1.9, 1.1, 2.4, 0.9])
    assert tight is not None and loose is not None and tight < 5 < loose
    # n satisfies (t + z) sd / sqrt(n) <= log 1.3, and n - 1 does not
    sd = __import__("statistics").stdev(math.log(v) for v in [0.8, 1.9, 1.1, 2.4, 0.9])
    assert (1.645 + 0.8416) * sd / math.sqrt(loose) <= math.log(1.3) * 1.05
    assert rounds_to_resolve([1.3, math.inf]) is None


def graded(problems: int, per_second: float, offset: float = 0.0) -> dict:
    """A run posed `problems` held-out problems, evaluated every 5 s from 30% right, rising
    `per_second` of them a second; each evaluation's per-problem results kept, right on the
    first ones (the same problems for every version and side)."""
    points = [(5.0 * i + offset, 0.3 + per_second * 5.0 * i) for i in range(1, 13)]
    x = run(0.3, points)
    rights = [round(e["accuracy"] * problems) for e in x["evals"]]
    x["eval_correct"] = ["1" * k + "0" * (problems - k) for k in rights]
    return x


def test_the_held_out_sets_part_of_the_spread_shrinks_with_its_problems_and_is_paired():
    gains = [5, 10]
    spread = {n: evaluation_spread([graded(n, 0.01)], [graded(n, 0.005)], gains) for n in (100, 1600)}
    assert spread[100]["problems"] == 100 and spread[100]["observed_sd"] is None  # one round: none between rounds
    assert 0 < spread[1600]["sd"] < spread[100]["sd"] / 2.5  # ~1/sqrt(problems)
    # Both sides are redrawn with one draw: a side against itself is 1x whatever the draw.
    same = graded(100, 0.01)
    assert evaluation_spread([same], [same], gains)["sd"] == 0
    # Without per-problem results (runs saved before), nothing to say.
    bare = {k: v for k, v in same.items() if k != "eval_correct"}
    assert evaluation_spread([bare], [bare], gains) is None


def test_the_rounds_needed_with_more_problems_keep_the_runs_own_spread():
    gains = [5, 10]
    # 40 problems: the set's sampling makes about half the spread seen between rounds.
    fast = [graded(40, 0.01, offset=o) for o in (0.0, 3.0, -2.0, 6.0)]
    slow = [graded(40, r) for r in (0.005, 0.004, 0.006, 0.0045)]
    h = evaluation_spread(fast, slow, gains, resamples=100)
    seen = [round_ratio(f, b, gains) for f, b in zip(fast, slow)]
    assert h["observed_sd"] == pytest.approx(__import__("statistics").stdev(math.log(v) for v in seen))
    needs = h["rounds_for_1.3x_with_problems"]
    assert needs["x1"] == rounds_to_resolve(seen)  # as many problems: the spread seen
    assert needs["x16"] <= needs["x4"] < needs["x1"]
    assert 0.2 < h["share"] < 0.8


def test_rounds_differ_by_seed_and_sides_share_the_seeds():
    assert [round_seed(7, r) for r in range(3)] == [7, 8, 9]


def test_the_sweep_picks_the_rate_that_reaches_the_band_soonest():
    runs = {"1e-4": [linear(0.3, 2.0)], "2e-4": [linear(0.3, 1.0)], "4e-4": [run(0.3, [(10, 0.31), (20, 0.32)])]}
    assert best_setting(runs, [5, 10]) == "2e-4"
    # None reaches the band: the higher final accuracy wins.
    none = {"a": [run(0.3, [(10, 0.31)])], "b": [run(0.3, [(10, 0.33)])]}
    assert best_setting(none, [5, 10]) == "b"


def args(**kw):
    base = dict(rounds=2, first_round=0, lrs=[], sweep_rounds=1, reruns=0, band=[5, 15], sweep_with=[], steps=100)
    return argparse.Namespace(**(base | kw))


def test_rounds_give_every_side_the_rounds_seed_and_each_side_its_best_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "guarded", lambda fn, what, reruns: fn())
    calls = []
    speed = {"fast": {0.1: 1.0, 0.2: 3.0}, "slow": {0.1: 4.0, 0.2: 2.0}}  # seconds per point, by rate

    def side(name):
        def one(tag, seed, lr):
            calls.append((name, tag, seed, lr))
            return linear(0.3, speed[name][lr or 0.1]) | {"seed": seed}

        return one

    runs, sweep = common.run_rounds(
        {"fast": side("fast"), "slow": side("slow")}, args(lrs=[0.1, 0.2]), 7, tmp_path / "p.json"
    )
    assert sweep["best"] == {"fast": 0.1, "slow": 0.2}  # each side at its own best rate
    rounds = [c for c in calls if not c[1].startswith("sweep")]
    assert rounds == [("fast", "0", 7, 0.1), ("slow", "0", 7, 0.2), ("fast", "1", 8, 0.1), ("slow", "1", 8, 0.2)]
    sweeps = {c[2] for c in calls if c[1].startswith("sweep")}
    assert sweeps.isdisjoint({7, 8})  # the sweep's seeds are not the rounds'
    assert [x["seed"] for x in runs["fast"]] == [x["seed"] for x in runs["slow"]] == [7, 8]
    # More rounds later (to pool with --reanalyse) go on from the given round, at new seeds.
    calls.clear()
    more, _ = common.run_rounds({"fast": side("fast")}, args(rounds=1, first_round=2), 7, tmp_path / "q.json")
    assert calls == [("fast", "2", 9, None)] and [x["seed"] for x in more["fast"]] == [9]
    # Tags go into job names (DNS-1035 labels): a rate like 1e-04 must not appear in one.
    assert all(re.fullmatch(r"[a-z0-9-]+", tag) for _, tag, _, _ in calls)


def test_an_earlier_sweep_is_extended_not_rerun_and_only_with_the_same_settings(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "guarded", lambda fn, what, reruns: fn())
    calls = []

    def one(tag, seed, lr):
        calls.append(lr)
        return linear(0.3, {0.05: 1.0, 0.1: 2.0}[lr]) | {"seed": seed}

    earlier = tmp_path / "earlier.json"  # a sweep at 0.1 only (its best, at the grid's edge)
    earlier.write_text(
        json.dumps({"args": vars(args(steps=100)), "sweep": {"runs": {"a": {"0.1": [one("s", 1, 0.1)]}}}})
    )
    calls.clear()
    runs, sweep = common.run_rounds(
        {"a": one}, args(rounds=0, lrs=[0.05, 0.1], sweep_with=[earlier]), 7, tmp_path / "p"
    )
    assert calls == [0.05]  # 0.1 was tried already: only the new rate ran, and no rounds
    assert list(sweep["runs"]["a"]) == ["0.1", "0.05"] and sweep["best"] == {"a": 0.05} and runs == {"a": []}
    calls.clear()  # the runs-so-far file of a run stopped after its sweep extends a sweep too
    _, again = common.run_rounds({"a": one}, args(rounds=0, lrs=[0.05], sweep_with=[tmp_path / "p"]), 7, tmp_path / "q")
    assert calls == [] and again["best"] == {"a": 0.05}
    # The extended sweep and the one it extended, given together: each run counts once.
    both = common.earlier_sweeps([earlier, tmp_path / "p"], args(rounds=0, lrs=[0.05]))
    assert {rate: len(xs) for rate, xs in both["a"].items()} == {"0.1": 1, "0.05": 1}
    with pytest.raises(SystemExit, match="it ran with steps=100, this run with 200"):
        common.run_rounds({"a": one}, args(lrs=[0.05], sweep_with=[earlier], steps=200), 7, tmp_path / "p")


def test_the_guard_reruns_a_round_run_beside_other_programs(monkeypatch):
    loads = iter([0.9, 0.05])  # the first try ran beside 0.9 cores of other programs
    monkeypatch.setattr(contention, "wait_until_quiet", lambda limit: 0.0)
    monkeypatch.setattr(contention, "sample", lambda: None)
    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: next(loads))
    tries = []
    record = contention.guarded(lambda: tries.append(1) or {"x": len(tries)}, "side round 0", reruns=2)
    assert record == {"x": 2, "foreign_cores": 0.05, "contended_tries": [0.9]}
    loads = iter([0.9, 0.8])
    monkeypatch.setattr(contention, "foreign_cores", lambda a, b: next(loads))
    with pytest.raises(SystemExit, match="every try ran beside other programs"):
        contention.guarded(lambda: {}, "side round 1", reruns=1)


def test_foreign_load_is_the_machines_busy_time_less_the_benchmarks_own():
    a = contention.CpuSample(machine_busy=100.0, own=10.0, wall=0.0)
    b = contention.CpuSample(machine_busy=104.0, own=12.0, wall=2.0)
    assert contention.foreign_cores(a, b) == pytest.approx(1.0)  # 4 s busy, 2 s ours, in 2 s
    assert contention.foreign_cores(a, contention.CpuSample(101.0, 12.0, 2.0)) == 0.0  # tick granularity


def test_a_program_the_benchmark_did_not_start_shows_as_foreign_load_and_its_own_child_does_not():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"
    # Its own child, waited for: counted as the benchmark's.
    before = contention.sample()
    subprocess.run([sys.executable, "-c", burn], check=True)
    own = contention.sample()
    assert own.own - before.own >= 1.4
    # A detached program (its parent exits at once: nobody here waits for it) is foreign.
    before = contention.sample()
    detach = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
    subprocess.run([sys.executable, "-c", detach], check=True)
    time.sleep(2.5)
    after = contention.sample()
    assert contention.foreign_cores(before, after) * (after.wall - before.wall) >= 1.2


def test_results_saved_before_the_clocks_are_read_on_the_training_clock_only(capsys):
    old = [{k: v for k, v in linear(0.3, s).items() if k != "clock_origins"} for s in (1.0, 2.0)]
    out = common.print_headlines("fast", "slow", {"fast": old[:1], "slow": old[1:]}, args())
    assert list(out) == ["time"] and out["time"]["median"] == pytest.approx(2.0)
    assert "clock time: no estimate" in (printed := capsys.readouterr().out) and "per round 2.00x" in printed


def test_a_reanalysis_pools_the_saved_rounds_and_runs_nothing(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": {"x": [{"r": 0}], "y": [{"r": 0}]}}))
    b.write_text(json.dumps({"runs": {"x": [{"r": 1}]}}))
    args = argparse.Namespace(reanalyse=[a, b], rounds=3, name="n")
    runs, sweep = common.gather_runs(args, lambda tmp: pytest.fail("a reanalysis ran a side"), ["x", "y"])
    assert runs == {"x": [{"r": 0}, {"r": 1}], "y": [{"r": 0}]} and sweep == {}
    assert args.rounds == 2  # the report counts the rounds it pooled
    # Two results of the same rounds are not pooled as if independent.
    for path in (a, b):
        path.write_text(json.dumps({"runs": {"x": [{"seed": 42}]}}))
    with pytest.raises(SystemExit, match="x has two runs at one seed"):
        common.gather_runs(args, lambda tmp: pytest.fail("a reanalysis ran a side"), ["x"])


def test_a_reanalysis_is_kept_only_under_a_name_given_and_with_its_rounds_machine(tmp_path, monkeypatch, capsys):
    """Kept under the benchmark's own name, a reanalysis would replace that file (its record and
    machine); kept under a given name, it says where its rounds ran, not where it was recomputed."""
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"machine": {"cpu": "Intel(R) Xeon(R) Processor", "cpus": 2}, "runs": {"x": [{"r": 0}]}}))
    saved = []
    monkeypatch.setattr(common, "save", lambda name, result, command, ran_on=None: saved.append((name, ran_on)))
    for name in (None, "again"):
        args = argparse.Namespace(reanalyse=[a], rounds=1, name=name, default_name="pipeline_vs_sync")
        common.gather_runs(args, lambda tmp: pytest.fail("a reanalysis ran a side"), ["x"])
        common.save_runs(args, {}, "python -m bench.pipeline_vs_sync --reanalyse a.json")
    assert "give --name to keep it" in capsys.readouterr().out
    [(name, ran_on)] = saved
    assert name == "again" and ran_on["cpu"] == "Intel(R) Xeon(R) Processor" and "reanalysed_on" in ran_on


def _child(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)


def test_an_engines_ready_line_is_seen_when_it_arrives_with_the_logs_before_it():
    """Benchmark 12's engines side by side: vLLM logs to stdout before the child's "ready", and
    both can arrive in one read. A buffered readline then held "ready" while select waited on a
    silent pipe: the start looked hung for the whole timeout (it failed benchmark 12 twice)."""
    from bench.engines_side_by_side import NotStarted, wait_ready

    logs = "".join(f"INFO log line {i}\n" for i in range(200))
    p = _child(f"import sys, time; sys.stdout.write({logs!r} + 'ready\\n'); sys.stdout.flush(); time.sleep(30)")
    try:
        t0 = time.time()
        wait_ready(p, time.time() + 10)
        assert time.time() - t0 < 5
    finally:
        p.kill()
        p.wait()
    quiet = _child("import time; print('not ready', flush=True); time.sleep(30)")  # never says it
    try:
        with pytest.raises(NotStarted, match="did not start"):
            wait_ready(quiet, time.time() + 1)
    finally:
        quiet.kill()
        quiet.wait()
    dead = _child("print('INFO starting'); raise SystemExit(3)")
    with pytest.raises(NotStarted, match=r"failed before it was ready \(3\)"):
        wait_ready(dead, time.time() + 10)
