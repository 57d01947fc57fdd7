"""Shared bench harness: alternate the sides of a comparison, repeat, report median and spread.

This machine is shared and noisy, so a figure is only ever a ratio of two sides measured in
the same run, interleaved A B A B … so that background load hits both alike.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.analysis import CLOCKS, band_headline, best_setting, has_clock, round_seed
from bench.contention import guarded
from bench.results_store import RESULTS, read_result, write_result
from pipelinerl.spec import load_job, load_yaml


def alternate(sides: dict[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each side's measurement `warmup` times (discarded), then `repeats` rounds, interleaved.

    Each callable returns one measured value (seconds, or a rate); the lists keep round order.
    """
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            out[name].append(fn())
    return out


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(a: list[float], b: list[float]) -> dict[str, float]:
    """a[i]/b[i] per round (rounds ran back to back, so they share the background load)."""
    return summary([x / y for x, y in zip(a, b)])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def one_rank_distributed_env() -> None:
    """torch.distributed's environment for a benchmark that is one rank on its own, on a free
    port (a fixed one clashed with a run beside it: the test suite's other worker)."""
    from pipelinerl.ports import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def gpu_or_smoke(args, name: str) -> tuple[bool, Path | None]:
    """A GPU benchmark's device and results folder: the GPU, unless `--smoke` checks the script on
    CPU with tiny shapes (its figures land only in `--results-dir`, never in bench/results);
    neither a GPU nor `--smoke`: it stops."""
    import torch

    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        raise SystemExit(f"bench.{name} needs a CUDA GPU (or --smoke to check the script on CPU)")
    return on_gpu, args.results_dir or (None if args.smoke else RESULTS)


def cpu_generation() -> str | None:
    """ "family F model M" from /proc/cpuinfo (None where it does not say)."""
    try:
        fields = dict(
            (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in open("/proc/cpuinfo")) if v
        )
    except OSError:
        return None
    family, model = fields.get("cpu family"), fields.get("model")
    return f"family {family} model {model}" if family and model else None


def machine() -> dict[str, object]:
    import torch

    from pipelinerl import tiny_model

    info: dict[str, object] = {
        "host": platform.node(),
        "cpu": tiny_model.cpu_model(),
        "cpus": os.cpu_count(),
        # Every figure is points above a warm start: which one (its weights' hash) goes with it.
        "warm_starts": {
            name: {k: tiny_model.shipped_record(name)[k] for k in ("sha256", "warm_start_accuracy")}
            for name in tiny_model.WARM_STARTS
        },
        # VMs name their CPU alike ("AMD EPYC") across generations that train 2.7x apart (the
        # long-tail job's step on a family 23 model 1, Zen 1, against the EPYC of 2026-12-03):
        # the generation, and the kernels torch dispatches to on it, tell them apart.
        "cpu_generation": cpu_generation(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


def save(name: str, result: dict, command: str, folder: Path = RESULTS, ran_on: dict | None = None) -> Path:
    """bench/results/<name>.json (or `folder`/<name>.json) with the machine (`ran_on`: the one its
    rounds ran on, where that is not this one), the command that reproduces it and the time (a
    summary and the whole result compressed where its runs carry per-step records:
    bench/results_store.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    payload = {
        "benchmark": name,
        "command": command,
        "machine": ran_on or machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    write_result(path, payload)
    return path


def pooled_runs(paths: list[str | Path], sides: list[str]) -> tuple[dict[str, list[dict]], dict]:
    """The saved runs (`{"runs": {side: [run, ...]}}`) of several results files, pooled per side,
    in file order (sides with no runs are left out), and the machine they ran on (`one_machine`)."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    machines: dict[str, dict] = {}
    for path in paths:
        result = read_result(path)
        machines[str(path)] = result.get("machine", {})
        saved = result["runs"]
        for side in runs:
            runs[side] += saved.get(side, [])
    for side, xs in runs.items():  # the same round twice is a re-timing, not an independent round
        seeds = [x["seed"] for x in xs if "seed" in x]
        if len(set(seeds)) < len(seeds):
            raise SystemExit(
                f"--reanalyse: {side} has two runs at one seed ({sorted(seeds)}): give later rounds --first-round"
            )
    return {side: xs for side, xs in runs.items() if xs}, one_machine(machines)


MACHINE_KEYS = ("cpu", "cpus", "cpu_generation", "cpu_capability", "device")


def one_machine(machines: dict[str, dict]) -> dict:
    """The machine pooled rounds ran on: each field as the first record saying it. Rounds pooled
    into one interval must come from one kind of machine (MACHINE_KEYS agree): a ratio's spread
    between machines is not its spread between seeds. Records that do not say (older ones) are
    not held to it."""
    merged: dict = {}
    said: dict[str, str] = {}  # field -> the file that said it first
    for path, machine in machines.items():
        for key, value in machine.items():
            if value is None:
                continue
            if key not in merged:
                merged[key], said[key] = value, path
            elif key in MACHINE_KEYS and merged[key] != value:
                raise SystemExit(
                    f"--reanalyse: {said[key]} ran on {key} {merged[key]!r}, {path} on {value!r}: "
                    "rounds of different machines are not one sample"
                )
    return merged


def set_fields(spec: dict, items: list[str]) -> None:
    """Change a job's spec in place by "FIELD=VALUE" items (dotted camelCase paths, YAML values)."""
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{item!r}: expected FIELD=VALUE, e.g. rl.maxLag=2")
        *parents, leaf = field.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = load_yaml(value)  # as kubectl reads it: 5e-05 a number (YAML 1.1 wants a dot)


SWEEP_SEED_OFFSET = 1000  # sweep runs' seeds: apart from every round's


def add_method_args(ap) -> None:
    """The options of the method every learning-speed benchmark follows (bench/analysis.py)."""
    ap.add_argument("--band", type=float, nargs=2, default=[5, 15], metavar=("LO", "HI"),
                    help="the headline's targets: every point from warm start + LO to + HI")  # fmt: skip
    ap.add_argument("--lrs", type=float, nargs="*", default=[],
                    help="learning-rate grid swept on every side first (each side then runs at its best)")  # fmt: skip
    ap.add_argument("--sweep-rounds", type=int, default=1, help="runs per side and learning rate in the sweep")
    ap.add_argument("--first-round", type=int, default=0,
                    help="the first round's index (its seed): more rounds, to pool with --reanalyse")  # fmt: skip
    ap.add_argument("--reruns", type=int, default=2, help="tries of a round that ran beside other programs")
    ap.add_argument("--sweep-with", metavar="JSON", nargs="+", default=[],
                    help="earlier results of this benchmark, same settings: their sweep runs join this sweep "
                         "(a rate they tried is not run again); with --rounds 0, a grid extended alone")  # fmt: skip


def method_flags(args) -> str:
    """The method's options as given, for the command that reproduces a result."""
    flags = "" if args.band == [5, 15] else f" --band {args.band[0]:g} {args.band[1]:g}"
    if args.lrs:
        flags += f" --lrs {' '.join(f'{x:g}' for x in args.lrs)} --sweep-rounds {args.sweep_rounds}"
    flags += f" --first-round {args.first_round}" if args.first_round else ""
    return flags + "".join(f" --sweep-with {p}" for p in args.sweep_with)


# What an earlier result may differ in and still lend its sweep runs: how many runs, which, and
# what they are reported against.
RUN_COUNT_ARGS = set("rounds first_round lrs sweep_rounds reruns name reanalyse sweep_with sides modes curve".split())


def earlier_sweeps(paths: list[str], args) -> dict[str, dict[str, list[dict]]]:
    """The sweep runs of earlier results per side and rate (`--sweep-with`: saved results, or the
    runs-so-far file of one stopped during its rounds); refused, naming the setting, unless they
    ran with every setting of this run but the number of runs."""
    out: dict[str, dict[str, list[dict]]] = {}
    for path in paths:
        saved = read_result(path)
        for key, value in vars(args).items():
            theirs = saved["args"].get(key, value)
            same = Path(theirs).resolve() == Path(value).resolve() if key == "job" else theirs == value
            if key not in RUN_COUNT_ARGS and not same:
                raise SystemExit(f"--sweep-with {path}: it ran with {key}={theirs!r}, this run with {value!r}")
        for side, by_rate in saved.get("sweep", {}).get("runs", {}).items():
            for rate, runs in by_rate.items():
                have = out.setdefault(side, {}).setdefault(rate, [])
                # once each: a sweep that extended another carries that one's runs too
                have.extend(r for r in runs if r not in have)
    return out


def band_gains(args) -> list[float]:
    lo, hi = args.band
    return [lo + i for i in range(int(hi - lo) + 1)]


def run_rounds(sides: dict[str, Callable[..., dict]], args, base_seed: int, partial: Path) -> tuple[dict, dict]:
    """The learning-rate sweep (`args.lrs`: every side at every rate, `args.sweep_rounds` runs
    each; a side then runs at its best, `best_setting`), then `args.rounds` rounds alternating the
    sides, round r (from `args.first_round`) at seed `round_seed(base_seed, r)` on every side. Each run goes through the
    contention guard. `sides[name](tag, seed=..., lr=...)` runs one and returns its record.
    Returns the runs per side and the sweep (its runs and each side's best rate)."""
    sweep: dict = {"runs": {}, "best": {}}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    seeds = [round_seed(base_seed, SWEEP_SEED_OFFSET + i) for i in range(args.sweep_rounds)]
    earlier = earlier_sweeps(args.sweep_with, args)

    here = machine()

    def keep() -> None:  # the runs so far, with what extends or reanalyses them (and where they ran)
        partial.write_text(
            json.dumps({"args": vars(args), "machine": here, "runs": runs, "sweep": sweep}, default=str) + "\n"
        )

    for side, run in sides.items() if args.lrs else ():
        tried = sweep["runs"][side] = dict(earlier.get(side, {}))  # at the same seeds as these
        for j, lr in enumerate(args.lrs):  # the tag names the rate by its index: tags go into job names
            if f"{lr:g}" in tried:
                continue
            tried[f"{lr:g}"] = [
                guarded(partial_run(run, f"sweep{j}-{i}", seed, lr), f"{side} sweep lr {lr:g} run {i}", args.reruns)
                for i, seed in enumerate(seeds)
            ]
            keep()
        sweep["best"][side] = float(best_setting(tried, band_gains(args)))
        finals = {lr: statistics.fmean(x["evals"][-1]["accuracy"] for x in xs) for lr, xs in tried.items()}
        of = ", ".join(f"{lr} (final accuracy {a:.1%})" for lr, a in finals.items())
        print(f"  {side}: best learning rate {sweep['best'][side]:g} of {of}", flush=True)
    for r in range(args.first_round, args.first_round + args.rounds):
        for side, run in sides.items():
            one = partial_run(run, str(r), round_seed(base_seed, r), sweep["best"].get(side))
            runs[side].append(guarded(one, f"{side} round {r}", args.reruns))
            keep()
    return runs, sweep


def add_results_args(ap, name: str) -> None:
    """--name and --reanalyse, read by `gather_runs` and `save_runs`."""
    ap.add_argument("--name", help=f"results file: bench/results/NAME.json (default {name}; with --reanalyse: none)")
    ap.add_argument(
        "--reanalyse",
        metavar="JSON",
        nargs="+",
        help="rebuild the report from saved results (their rounds pooled), run nothing; kept only with --name",
    )
    ap.set_defaults(default_name=name)


def gather_runs(args, sides: Callable[[Path], dict[str, Callable[..., dict]]], names: list[str]) -> tuple[dict, dict]:
    """The runs per side to report, and the sweep: with --reanalyse the saved results' rounds
    pooled (no sweep), else `run_rounds` from the job's seed, `sides(scratch folder)` giving each
    side's run, the runs so far kept in RESULTS/NAME.partial.json (--reanalyse reads it too)."""
    # A report rebuilt from saved results is printed, and kept only under a name given for it:
    # kept under the benchmark's own name it would replace that file's record.
    args.keep = bool(args.name) or not args.reanalyse
    args.name = args.name or args.default_name
    if args.reanalyse:
        runs, args.ran_on = pooled_runs(args.reanalyse, names)
        args.rounds = max(len(xs) for xs in runs.values())
        return runs, {}
    RESULTS.mkdir(parents=True, exist_ok=True)
    base_seed = load_job(args.job).spec.trainer.seed
    with tempfile.TemporaryDirectory(prefix=f"bench-{args.name}-") as tmp:
        return run_rounds(sides(Path(tmp)), args, base_seed, RESULTS / f"{args.name}.partial.json")


def save_sweep(args, sweep: dict, command: str) -> None:
    """A sweep alone (`--rounds 0`, e.g. a grid extended with --sweep-with): its runs and each
    side's best rate; no rounds, so no headline."""
    save_runs(args, {"args": vars(args), "sweep": sweep}, command)


def save_runs(args, result: dict, command: str) -> None:
    """`save` the report, and drop the runs-so-far file that it now supersedes; a report rebuilt
    from saved results only where a --name was given (`gather_runs`), with their machine."""
    if not args.keep:
        print("(a report only: give --name to keep it)")
        return
    save(args.name, result, command, ran_on=args.ran_on | {"reanalysed_on": machine()} if args.reanalyse else None)
    if not args.reanalyse:
        (RESULTS / f"{args.name}.partial.json").unlink(missing_ok=True)


def partial_run(run: Callable[..., dict], tag: str, seed: int, lr: float | None) -> Callable[[], dict]:
    return functools.partial(run, tag, seed=seed, lr=lr)


def ratio_text(v: float | None) -> str:
    return "-" if v is None else ("∞" if v == math.inf else f"{v:.2f}x")


def estimate_text(h: dict) -> str:
    """A band headline's estimate: its geometric mean and 90% t-interval over rounds."""
    if h["geomean"] is None:
        return "no estimate (too few rounds, or a round with no target reached by either side)"
    return f"{ratio_text(h['geomean'])} (90% t-interval {ratio_text(h['low'])}-{ratio_text(h['high'])})"


def print_headlines(fast: str, baseline: str, runs: dict[str, list[dict]], args) -> dict:
    """baseline/fast time-to-target ratios over the band on every clock: the geometric mean of
    the per-round band medians and its 90% t-interval (one estimator), the rounds a 1.3x ratio
    needs at this spread, the per-round values (a target one side never reached censored at its
    bound); what they are printed as is what bench/README.md quotes."""
    out = {}
    gains = band_gains(args)
    both = runs[fast] + runs[baseline]
    for clock in [c for c in CLOCKS if all(has_clock(x, c) for x in both)]:  # results saved before: "time" only
        h = out[clock] = band_headline(runs[fast], runs[baseline], gains, clock)
        interval = estimate_text(h)
        rounds = ", ".join(map(ratio_text, h["per_round"]))
        print(
            f"{baseline}/{fast} time to target over +{gains[0]:g}..+{gains[-1]:g}, {h['rounds']} rounds, "
            f"clock {clock}: {interval}; per round {rounds}; median {ratio_text(h['median'])}"
            + (f"; 1.3x needs {h['rounds_for_1.3x']} rounds at this spread" if h["rounds_for_1.3x"] else "")
            + (f"; {h['censored']} round-targets censored at a run's end" if h["censored"] else "")
            + (f"; {h['both_missed']} round-targets missed by both" if h["both_missed"] else "")
            + (
                f"; {h['early']} of {h['targets']} run-targets reached before the first evaluation"
                if h["early"]
                else ""
            )
        )
    return out
