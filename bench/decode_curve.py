"""The decode curve and the throughput bound (benchmark 12): what this machine's physics lets the
pipeline reach against conventional RL with k steps per phase, printed beside benchmark 11's
measured samples/s ratios.

    python -m bench.decode_curve     # ~12 min: the tiny model's curve, the trainer's steps at 1 and
                                     # 2 cores and beside an engine, two engines side by side, the
                                     # tiny job's rollout path on one core, with and without updates

Measured, one engine on one core (vLLM's CPU build through the generator's own `Engine`):
the decode step's seconds against its running batch (1-128 sequences) and their contexts (8 and
128 prompt tokens), each point the difference of two rounds of B requests that decode 16 and 64
tokens (so prefill and start-up cancel), repeated and alternated; the trainer's tokens/s on each
example job's step (its samples at its lengths, packed, the trainer's loss, AdamW) with torch on
1 and on 2 threads. Fitted: base + per sequence + per sequence and context token
(`pipelinerl.planner.bound.fit_curve`). From them, `pipelinerl.planner.bound` gives the
samples/s ratio the pipeline can reach against each k for the tiny and the long-tail jobs'
completion lengths (the calibrations' samples): conventional phases generate on both cores (one
engine each, at the speed each keeps beside the other: `bench/engines_side_by_side.py`,
measured here) and train on both; the pipeline splits the cores, its trainer on one beside a
decoding engine (its tokens/s there, measured: `Machine.trainer_beside`). Each request's own
cost beside its decode steps (admission, output handling: short completions pay it per few
tokens): at the engine, what the short rounds took beyond their steps on the curve
(`fit_requests`); on this machine, where the rest of the rollout path (the generator's process,
the broker, the preprocessor) shares the engines' cores, what the tiny job's whole path gave a
sample on one core beyond the engine's steps (`bench/rollout_path.py`, `path_request_s`), which
the bound and the planner's costs take. The weight update's costs, on the same path: what runs
with the tiny job's updates landing at its steps (sent by the project's `WeightSender` from the
other core) took beyond runs without, per update (each engine's `pause_s`), and the sender's
seconds (the trainer's `update_s`). And the planner's costs
from this physics alone, one calibration per job (`machine_calibration`;
bench/results/NAME-JOB.calibration.yaml, for `pipelinerl plan --calibration`): what it predicts
for a benchmark-11 run is a prediction nothing of that run was fitted to.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import asdict

# Before torch loads OpenMP: on a shared machine, spin-waiting OpenMP threads (the default) slow
# small-model work ~15x whenever other processes hold the cores; passive waiting keeps the figures
# meaningful under contention. Set OMP_WAIT_POLICY=ACTIVE to measure the default on a quiet machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from bench import engines_side_by_side as side_by_side  # noqa: E402
from bench import rollout_path  # noqa: E402
from bench.calibrate_cpu import calibration_yaml  # noqa: E402
from bench.common import RESULTS, alternate, save, table  # noqa: E402
from bench.measured_machine import (  # noqa: E402
    JOBS,
    job_filtered_fraction,
    job_length_model,
    job_lengths,
    machine_of,
    measured_ratios,
    sample_of,
)
from bench.tiny_engine import decode_round, tiny_engine  # noqa: E402
from bench.trainer_rate import trainer_rates  # noqa: E402
from pipelinerl.planner.bound import (  # noqa: E402
    DecodeCurve,
    Machine,
    bound,
    fit_curve,
    fit_requests,
    machine_calibration,
    path_request_s,
)

BATCHES = (1, 4, 16, 64, 128)
CONTEXTS = (8, 128)
SHORT, LONG = 16, 64  # decode tokens of the two rounds whose difference is a point
KS = (1, 2, 4, 8)
SAMPLES_PER_STEP = 128  # both jobs' (examples/tiny-cpu.yaml, long-tail-cpu.yaml)
PATH_GROUPS = 192  # groups per timed run of the rollout path (the tiny job's: 1,536 samples)


def rollout_path_costs(curve: DecodeCurve, measured: dict) -> dict:
    """The rollout path's measurement (`bench/rollout_path.py`, the tiny job's) with the request
    cost it implies on `curve` (`path_request_s`, the engine at its full batch)."""
    lengths = job_lengths(JOBS["tiny"][0])
    assert lengths is not None
    request_s = path_request_s(
        curve,
        measured["seconds_per_sample_median"],
        measured["tokens_per_sample_median"],
        lengths[1],
        Machine.max_running,
    )
    return measured | {"request_s": request_s, "engine_request_s": curve.request_s}


async def curve_points(path: str, repeats: int) -> list[dict]:
    engine = await tiny_engine(path)
    rng = np.random.default_rng(0)
    points = []
    try:
        vocab = engine.llm.tokenizer.vocab_size if engine.llm.tokenizer else 64
        for context in CONTEXTS:
            for batch in BATCHES:
                prompts = [[int(t) for t in rng.integers(3, vocab, context)] for _ in range(batch)]
                loop = asyncio.get_running_loop()

                def timed(tokens: int):
                    def once() -> float:
                        return asyncio.run_coroutine_threadsafe(decode_round(engine, prompts, tokens), loop).result()

                    return once

                runs = await asyncio.to_thread(alternate, {"short": timed(SHORT), "long": timed(LONG)}, repeats)
                steps = [(b - a) / (LONG - SHORT) for a, b in zip(runs["short"], runs["long"])]
                step = float(np.median(steps))
                points.append(
                    {
                        "batch": batch,
                        "context": context + (SHORT + LONG) / 2,
                        "step_s": step,
                        "steps_s": steps,
                        "prompt": context,
                        "short_round_s": float(np.median(runs["short"])),  # per-request costs: `fit_requests`
                    }
                )
                print(f"  batch {batch:3d}, prompt {context:3d}: {1000 * step:.2f} ms per decode step", flush=True)
    finally:
        engine.shutdown()
    return points


def main() -> None:
    from bench.models import project_caches
    from pipelinerl.tiny_model import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="decode_curve")
    ap.add_argument("--side-by-side-seconds", type=float, default=20.0)
    args = ap.parse_args()
    project_caches()
    path = resolve_model_path("builtin:tiny-arith")
    print("decode step, one engine on one core (vLLM CPU build):", flush=True)
    points = asyncio.run(curve_points(path, args.repeats))
    curve = fit_curve([(p["batch"], p["context"], p["step_s"]) for p in points])
    curve = fit_requests(curve, [(p["batch"], p["prompt"], SHORT, p["short_round_s"]) for p in points])
    print(
        f"fitted: {1000 * curve.base_s:.2f} ms + {1000 * curve.per_seq_s:.3f} ms per sequence + "
        f"{1e6 * curve.per_token_s:.3f} us per sequence and context token; a batch of 128 costs "
        f"{curve.step_s(128, 128 * 48) / curve.step_s(1, 48):.1f}x one sequence's step; each request "
        f"{1000 * curve.request_s:.2f} ms beside its decode steps + {1e6 * curve.prefill_s_per_token:.1f} us "
        "per prompt token"
    )
    timed = {key: trainer_rates(path, job, args.repeats) for key, (job, _) in JOBS.items()}
    train = {key: rates for key, (rates, _) in timed.items()}
    beside = {
        key: {"tokens_per_s": b, "scaling": b["median"] / train[key][1]["median"]} for key, (_, b) in timed.items()
    }
    for key, rates in train.items():
        print(
            f"trainer tokens/s, {key} steps: "
            + ", ".join(f"{c} core(s) {s['median']:.0f}" for c, s in rates.items())
            + f"; 1 core beside an engine {beside[key]['tokens_per_s']['median']:.0f} ({beside[key]['scaling']:.2f}x)"
        )
    cores = max(train["tiny"])
    print(f"{cores} engines side by side, one thread each, unpinned (the colocated baseline's):", flush=True)
    engines = side_by_side.measure(cores, 64, args.side_by_side_seconds, args.repeats)
    print(f"each engine beside the others: {engines['engine_scaling']:.2f}x its tokens/s alone")
    print("the tiny job's rollout path on one core (its engine, its generator's and intake's work):", flush=True)
    trainer_cpu = 1 if cores > 1 else 0  # the pipeline's trainer beside the path's core
    # An update's cost is a few percent of a run's seconds: thrice the pairs (a run is ~4 s).
    measured = rollout_path.measure(JOBS["tiny"][0], PATH_GROUPS, 3 * args.repeats, trainer_cpu=trainer_cpu)
    rollout = rollout_path_costs(curve, measured)
    updates = rollout["update_costs"]
    print(
        f"  {1000 * rollout['seconds_per_sample_median']:.2f} ms per sample: each request "
        f"{1000 * rollout['request_s']:.2f} ms beside its decode steps (the engine's own "
        f"{1000 * curve.request_s:.2f}); each weight update "
        f"{1000 * updates['generator_s']:.1f} ms of the engine's core, "
        f"{1000 * updates['trainer_s']:.1f} ms of the trainer's"
    )
    command = f"python -m bench.decode_curve --repeats {args.repeats} --name {args.name}"
    result = {
        "points": points,
        "curve": asdict(curve),
        "trainer_tokens_per_s": {key: {str(c): s for c, s in rates.items()} for key, rates in train.items()},
        "engines_side_by_side": engines,
        "trainer_beside_engine": beside,
        "rollout_path": rollout,
    }
    rows, bounds, calibrations = [], {}, {}
    for key, (job, runs) in JOBS.items():
        machine = machine_of(result, key)
        assert machine is not None  # every JOBS entry's trainer was timed
        model_lengths = job_length_model(job)
        assert model_lengths is not None  # every JOBS entry has its calibration
        lengths, prompt = sample_of(model_lengths)
        calibrations[key] = machine_calibration(
            machine,
            model_lengths,
            f"physics-{key}",
            f"measured: `{command}` (bench/results/{args.name}.json), its decode curve, each request's cost on "
            f"the tiny job's rollout path, engines side by side and trainer steps of {job} (alone and beside an "
            "engine) and the weight update's costs to the path's core and the trainer (the tiny job's update), "
            "nothing fitted to a run; the task's lengths and filtered share: the built-in calibration's",
            job_filtered_fraction(job),
        )
        measured = measured_ratios(runs)
        for k in KS:
            filtered = job_filtered_fraction(job)
            b = bound(machine, lengths, prompt, SAMPLES_PER_STEP, k, filtered=filtered)
            one = bound(machine, lengths, prompt, SAMPLES_PER_STEP, k, engines=1, filtered=filtered)
            bounds[f"{key}/k={k}"] = {
                "ratio": b.ratio,
                "ratio_one_engine": one.ratio,
                "tail_share": b.tail_share,
                "split": b.generator_cores,
            }
            got = measured.get(k)
            rows.append(
                [key, k, f"{b.ratio:.2f}", f"{b.tail_share:.0%}", f"{one.ratio:.2f}", f"{got:.2f}" if got else "-"]
            )
    headers = ["job", "k", "bound: pipeline / k samples/s", "phase in its tail", "bound, one engine a phase"]
    print(table([*headers, "measured (benchmark 11, one engine)"], rows))
    saved = save(args.name, result | {"bounds": bounds}, command)
    print(f"wrote {saved}")
    for key, calib in calibrations.items():
        out = RESULTS / f"{args.name}-{key}.calibration.yaml"
        out.write_text(calibration_yaml(calib))
        print(
            f"wrote {out} (the planner's costs: pipelinerl plan {JOBS[key][0]} --calibration bench/results/{out.name})"
        )


if __name__ == "__main__":
    main()
