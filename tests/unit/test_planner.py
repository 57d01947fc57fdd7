import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from pipelinerl_cli.main import main
from pipelinerl.planner.calibration import (
    CALIBRATIONS,
    Calibration,
    CalibrationError,
    Lengths,
    at_tensor_parallel,
    load_calibration,
    parse_calibration,
)
from pipelinerl.planner.recommend import (
    LAG_TOLERANCE,
    LAGS,
    LENGTH_VARIANTS,
    format_plan,
    ks,
    plan,
    splits,
    variants_of,
    vary,
)
from pipelinerl.planner.sim_params import MIN_STEPS, WINDOW_LIFETIMES
from pipelinerl.planner.sim_params import wave_groups
from pipelinerl.planner.simulation import simulate
from pipelinerl.spec import parse_job

H100 = load_calibration("h100-7b")
# A small GPU-like setup that simulates in well under a second.
SMALL = dict(samples_per_step=512, attempts=8, calib=H100, max_tokens=4096)


def lognormal(mean: float, sigma: float) -> Lengths:
    return Lengths(mean_tokens=mean, sigma=sigma, prompt_tokens=100)


def job(**spec) -> object:
    return parse_job(
        {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "plan-test"},
            "spec": spec,
        }
    )


def paper_job(samples_per_step: int = 1024):
    # The paper's setting (§5): 7B model, 1024 samples per step, 8 attempts (the reference
    # config), 8k-token generations; trainer pods of 8 GPUs.
    return job(
        model={"path": "Qwen/Qwen2.5-7B", "dtype": "bfloat16", "maxSeqLen": 8704},
        rl={"attempts": 8},
        generator={"gpus": 1, "sampling": {"maxTokens": 8192}},
        trainer={"gpus": 8, "samplesPerStep": samples_per_step, "microBatchTokens": 16384, "zeroStage": 3},
    )


def test_sync_waits_on_its_longest_sequence():
    even, tail = lognormal(1000, 0.0), lognormal(1000, 1.2)
    sync_even = simulate("sync", 8, 24, 0, lengths=even, **SMALL)
    sync_tail = simulate("sync", 8, 24, 0, lengths=tail, **SMALL)
    pipe_even = simulate("pipeline", 8, 24, 4, lengths=even, **SMALL)
    pipe_tail = simulate("pipeline", 8, 24, 4, lengths=tail, **SMALL)
    # The tail has fewer tokens (clipped at maxTokens) and still slows sync down the most:
    # each step decodes until its longest sequence is done, with an ever emptier batch.
    assert sync_tail.samples_per_s < 0.8 * sync_even.samples_per_s
    assert sync_tail.samples_per_s / sync_even.samples_per_s < pipe_tail.samples_per_s / pipe_even.samples_per_s
    assert sync_tail.step_s > SMALL["max_tokens"] * H100.decode_base_s
    assert sync_tail.gen_fill < sync_even.gen_fill


def equal_lengths_calibration(**update) -> Calibration:
    """Equal lengths (50 tokens after a 20-token prompt), round costs: every term is visible."""
    return Calibration(
        name="t",
        decode_base_s=0.01,
        decode_per_seq_s=0.001,
        max_batch=64,
        prefill_s_per_token=5e-4,
        train_s_per_token=0.002,
        train_scaling=0.9,
        optimizer_step_s=0.3,
        weight_sync_s=0.2,
        pause_s=0.1,
        lengths=Lengths(mean_tokens=50, sigma=0, prompt_tokens=20),
    ).model_copy(update=update)


@pytest.mark.parametrize("pause_s", [0.1, 0.5])
def test_sync_step_follows_the_cost_equations(pause_s):
    # Equal lengths, one engine holding the whole step: every term of the model is visible.
    calib = equal_lengths_calibration(pause_s=pause_s)
    r = simulate("sync", 1, 4, 0, samples_per_step=32, attempts=8, calib=calib, max_tokens=100, steps=4, warmup=1)
    prefill = 4 * 5e-4 * 20  # once per group of 8
    decode = 50 * (0.01 + 0.001 * 32)  # 50 steps of a 32-sequence batch
    train = 32 * (50 + 20) * 0.002 / (4 * 0.9**2) + 0.3  # 4 trainers: two doublings
    # The next step's prompts wait for the broadcast and for the engine's pause.
    step = prefill + decode + train + max(0.2, pause_s)
    assert r.step_s == pytest.approx(step, rel=1e-9)
    assert r.gen_busy == pytest.approx(decode / step, rel=1e-9)
    assert r.train_busy == pytest.approx((train + 0.2) / step, rel=1e-9)
    # Held (a generator's busy time): from its groups' admission at the broadcast's end, the rest
    # of the pause, the prefills, the decode; not the training, when it holds none.
    held = max(0.0, pause_s - 0.2) + prefill + decode
    assert r.gen_tokens_per_held_s == pytest.approx(32 * 50 / held, rel=1e-9)


def test_a_decode_step_slows_as_its_sequences_contexts_grow():
    # Each running sequence reads its KV cache: per_token per token of context (prompt + tokens
    # so far), so with B sequences started together the step time grows by B · per_token a step.
    calib = equal_lengths_calibration(decode_per_token_s=1e-5)
    r = simulate("sync", 1, 4, 0, samples_per_step=32, attempts=8, calib=calib, max_tokens=100, steps=4, warmup=1)
    first = 0.01 + 32 * (0.001 + 1e-5 * 20)  # the first step: contexts are the prompts
    decode = 50 * first + 32 * 1e-5 * 50**2 / 2  # ∫ over 50 steps of first + 32·1e-5·x
    step = 4 * 5e-4 * 20 + decode + 32 * 70 * 0.002 / (4 * 0.9**2) + 0.3 + 0.2
    assert r.step_s == pytest.approx(step, rel=1e-9)
    assert r.gen_tokens_per_busy_s == pytest.approx(32 * 50 / decode, rel=1e-9)
    assert calib.step_s(32, 20) == pytest.approx(first)


@pytest.mark.parametrize("cap", ["max_running", "kv_cache"])
def test_an_engine_runs_at_most_its_cap_of_sequences(cap):
    # Capped at 8 running sequences (the reference's llm_max_rollouts, or a KV cache of 8
    # sequences of 70 tokens), a 32-sample step runs as four groups of 8, one after the other.
    calib = equal_lengths_calibration(kv_cache_tokens=8 * 70 if cap == "kv_cache" else None)
    common = dict(samples_per_step=32, attempts=8, calib=calib, max_tokens=100, steps=4, warmup=1)
    r = simulate("sync", 1, 4, 0, max_running=8 if cap == "max_running" else None, **common)
    train = 32 * 70 * 0.002 / (4 * 0.9**2) + 0.3
    assert r.engine_batch == 8
    assert r.step_s == pytest.approx(4 * (5e-4 * 20 + 50 * (0.01 + 0.001 * 8)) + train + 0.2, rel=1e-9)
    assert r.gen_fill == pytest.approx(50 * (0.01 + 0.001 * 8) * 4 / r.step_s, rel=1e-9)  # full while decoding


def test_conventional_k_trains_a_phase_in_k_steps_and_sends_weights_once():
    # k = 2, split, one engine holding one step's sequences at a time: the trainer waits for the
    # whole phase (as the preprocessor holds it), takes both steps, then sends weights.
    calib = equal_lengths_calibration(max_batch=32)
    common = dict(samples_per_step=32, attempts=8, calib=calib, max_tokens=100, steps=6, warmup=2)
    trace: list[tuple] = []
    r = simulate("sync", 1, 4, 0, steps_per_generation=2, trace=trace, **common)
    half = 4 * 5e-4 * 20 + 50 * (0.01 + 0.001 * 32)  # one step's groups, prefilled and decoded
    train = 32 * 70 * 0.002 / (4 * 0.9**2) + 0.3
    assert r.step_s == pytest.approx((2 * half + 2 * train + 0.2) / 2, rel=1e-9)  # nothing overlaps
    # Step j of a phase trains at lag j; the weights go out once per phase, 3 phases.
    assert r.lag_max == 1 and r.lag_mean == pytest.approx(0.5) and r.steps_per_generation == 2
    assert [e[1] for e in trace if e[0] == "weights"] == [2, 4, 6]
    # Admission: one phase (k steps' worth of groups, 8) on the newest weights, consumed once its
    # update has landed (`lag_budget` with steps_per_generation 2; test_admission replays such a
    # trace into the generators' Admission).
    assert {e[-2] for e in trace} == {8} and max(e[-1] for e in trace) == 8
    assert [e[1:3] for e in trace if e[0] == "trained"] == [(8, 1), (16, 3), (24, 5)]
    assert r.samples_trained == 6 * 32 and r.label == "conventional k=2, split"
    # Colocated: the same devices generate the whole phase, then train both steps.
    c = simulate("sync", 1, 1, 0, steps_per_generation=2, colocated=True, **common)
    train_1 = 32 * 70 * 0.002 + 0.3  # one device
    assert c.step_s == pytest.approx((2 * half + 2 * train_1 + 0.2) / 2, rel=1e-9)
    assert c.gen_busy + c.train_busy <= 1 + 1e-9 and c.label == "conventional k=2, colocated"


def test_a_baseline_that_recomputes_log_probs_pays_a_forward_pass_per_trained_token():
    # verl, and TRL with steps_per_generation > 1, recompute the old policy's log-probs before
    # a phase's k steps: a forward pass over its tokens (1/3 of a forward and backward). This
    # project's trainer takes the engines' log-probs, as the pipeline's does: no such pass.
    calib = equal_lengths_calibration(max_batch=32)
    common = dict(samples_per_step=32, attempts=8, calib=calib, max_tokens=100, steps=6, warmup=2)
    half = 4 * 5e-4 * 20 + 50 * (0.01 + 0.001 * 32)
    compute = 32 * 70 * 0.002 / (4 * 0.9**2)
    r = simulate("sync", 1, 4, 0, steps_per_generation=2, logprob_pass=1 / 3, **common)
    assert r.step_s == pytest.approx((2 * half + 2 * (compute * 4 / 3 + 0.3) + 0.2) / 2, rel=1e-9)
    with pytest.raises(ValueError, match="logprob_pass"):
        simulate("pipeline", 1, 4, 1, logprob_pass=0.25, **common)
    # The plan prices it on the baseline only: the pipeline's rate stands, its ratios rise.
    tiny = parse_job(yaml.safe_load(open("examples/tiny-cpu.yaml")))
    cpu = load_calibration("cpu-tiny")
    plain, peer = plan(tiny, 2, cpu, max_k=4), plan(tiny, 2, cpu, max_k=4, baseline_logprob_pass=1 / 3)
    assert peer.pipeline == plain.pipeline and peer.baseline_logprob_pass == 1 / 3
    assert peer.speedup_vs_best_colocated > plain.speedup_vs_best_colocated
    assert "recomputing log-probs (+33% training)" in format_plan(peer)


def test_conventional_k_amortises_the_long_tail():
    # A long-tailed phase waits for its longest sequence once per k steps; generation and
    # training never overlap (the trainer waits for the whole phase), split or colocated.
    lengths = lognormal(1000, 1.0)
    rates = [simulate("sync", 8, 24, 0, lengths=lengths, steps_per_generation=k, **SMALL) for k in (1, 4, 16)]
    assert rates[0].samples_per_s < rates[1].samples_per_s < rates[2].samples_per_s
    assert [r.lag_max for r in rates] == [0, 3, 15]
    assert all(r.gen_busy * 8 / 32 + r.train_busy * 24 / 32 <= 1 + 1e-9 for r in rates)  # one at a time
    colocated = simulate("sync", 32, 32, 0, lengths=lengths, steps_per_generation=4, colocated=True, **SMALL)
    assert colocated.gen_busy + colocated.train_busy <= 1 + 1e-9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mode="pipeline", n_gen=8, n_train=24, max_lag=1, steps_per_generation=2), "steps_per_generation"),
        (dict(mode="sync", n_gen=8, n_train=24, max_lag=0, colocated=True), "colocated"),
        (dict(mode="sync", n_gen=8, n_train=24, max_lag=0, steps_per_generation=4, steps=6), "whole phases"),
        (dict(mode="sync", n_gen=8, n_train=24, max_lag=0, max_running=0), "max_running"),
        (dict(mode="pipeline", n_gen=8, n_train=24, max_lag=-1), "max_lag"),
        (dict(mode="pipeline", n_gen=8, n_train=24, max_lag=2, max_inflight=0), "max_inflight"),
    ],
)
def test_impossible_simulations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(**kwargs, **SMALL)


def test_the_window_spans_several_lifetimes_of_the_longest_sequence():
    # A pipeline is measured once its start-up's groups have all finished, over at least
    # WINDOW_LIFETIMES of the longest group lifetime seen; a sync phase over whole phases.
    r = simulate("pipeline", 8, 24, 8, lengths=lognormal(1000, 1.0), **SMALL)
    assert r.window_s >= WINDOW_LIFETIMES * r.longest_s > 0
    assert r.window_s / r.step_s >= MIN_STEPS - 1e-9
    s = simulate("sync", 8, 24, 0, lengths=lognormal(1000, 1.0), steps_per_generation=4, **SMALL)
    assert s.window_s / s.step_s == pytest.approx(round(s.window_s / s.step_s)) and s.window_s / s.step_s % 4 == 0


def test_pipeline_generators_idle_only_while_paused():
    # With a lag budget longer than the longest completions take: a shorter one holds
    # admission back while they run (test_a_short_lag_budget_holds_long_tailed_generation_back).
    lengths = lognormal(1000, 1.0)
    free = simulate("pipeline", 8, 24, 12, lengths=lengths, **SMALL | {"calib": H100.model_copy(update={"pause_s": 0})})
    paused = simulate(
        "pipeline", 8, 24, 12, lengths=lengths, **SMALL | {"calib": H100.model_copy(update={"pause_s": 3})}
    )
    assert free.gen_busy > 0.99
    assert 1 - paused.gen_busy == pytest.approx(3 / paused.step_s, rel=0.05)


def test_trainer_bound_pipeline_runs_max_lag_ahead():
    # Fast generators fill the whole lag budget during each step: tokens are max_lag old (but
    # for those admitted later, behind a long group still generating).
    for max_lag in (1, 4):
        r = simulate("pipeline", 30, 2, max_lag, lengths=lognormal(1000, 1.0), **SMALL)
        assert r.train_busy > 0.99 and r.lag_settled
        assert r.lag_max == max_lag and r.lag_mean >= 0.85 * max_lag and r.dropped == 0


def test_capping_groups_in_flight_trades_throughput_for_freshness():
    # The same trainer-bound pipeline, each engine running at most one group at a time
    # (maxInflightGroups 1; 4 engines for a step of 64 groups): samples far fresher than the
    # lag budget allows, for some throughput, and nothing lost.
    free = simulate("pipeline", 4, 2, 4, lengths=lognormal(1000, 1.0), **SMALL)
    capped = simulate("pipeline", 4, 2, 4, lengths=lognormal(1000, 1.0), max_inflight=1, **SMALL)
    assert free.lag_mean > 3.4 and capped.lag_mean < 1.5 and capped.dropped == 0
    assert capped.samples_per_s < free.samples_per_s and capped.train_busy < free.train_busy
    assert capped.samples_started == capped.samples_trained + capped.samples_in_flight
    # A cap the lag budget never reaches changes nothing.
    loose = simulate("pipeline", 4, 2, 4, lengths=lognormal(1000, 1.0), max_inflight=100, **SMALL)
    assert (loose.samples_per_s, loose.lag_mean) == pytest.approx((free.samples_per_s, free.lag_mean), rel=1e-3)


def test_pipeline_with_max_lag_0_is_sync():
    lengths = lognormal(1000, 1.0)
    p0 = simulate("pipeline", 8, 24, 0, lengths=lengths, **SMALL)
    sync = simulate("sync", 8, 24, 0, lengths=lengths, **SMALL)
    assert {**p0.__dict__, "mode": "sync"} == sync.__dict__
    # No overlap: generation and training take turns.
    assert sync.gen_busy + sync.train_busy <= 1 + 1e-9
    assert sync.lag_max == 0 and sync.dropped == 0


@pytest.mark.parametrize("max_lag", [1, 2, 4])
def test_pipeline_lag_within_budget_and_fractions(max_lag):
    r = simulate("pipeline", 8, 24, max_lag, lengths=lognormal(1000, 1.0), **SMALL)
    assert r.lag_max <= max_lag and r.lag_p95 <= max_lag and 0 < r.lag_mean <= max_lag
    for frac in (r.gen_busy, r.gen_fill, r.train_busy, r.dropped):
        assert 0 <= frac <= 1
    # Overlap: both roles are busy more than half the time together, once the budget is more
    # than a step (at 1 the long completions, several steps long, hold admission back).
    assert r.gen_busy + r.train_busy > (1 if max_lag > 1 else 0.85)


def test_a_short_lag_budget_holds_long_tailed_generation_back():
    # Groups are trained in the order they finish, so admission counts from the oldest group
    # still generating: a long one is never overtaken past max_lag (nothing dropped), and
    # generation slows while it comes close; a budget longer than it takes frees it.
    lengths = lognormal(1000, 1.0)
    short, long = (simulate("pipeline", 8, 24, lag, lengths=lengths, **SMALL) for lag in (2, 8))
    assert short.dropped == 0 and long.dropped == 0
    assert short.samples_per_s < 0.6 * long.samples_per_s


def test_equal_lengths_are_never_too_stale():
    # Groups finish in the order they start, so the admission budget alone bounds the lag.
    r = simulate("pipeline", 8, 24, 2, lengths=lognormal(1000, 0.0), **SMALL)
    assert r.dropped == 0 and r.lag_max <= 2


def test_overlap_never_loses_without_contention():
    for n_gen, n_train in [(4, 28), (16, 16), (28, 4)]:
        pipe = simulate("pipeline", n_gen, n_train, 2, lengths=lognormal(1000, 1.0), **SMALL)
        sync = simulate("sync", n_gen, n_train, 0, lengths=lognormal(1000, 1.0), **SMALL)
        assert pipe.samples_per_s > sync.samples_per_s


@pytest.mark.parametrize(
    "mode,max_lag,waves",
    [("sync", 0, 0), ("pipeline", 1, 0), ("pipeline", 4, 0), ("pipeline", 1, 5), ("pipeline", 4, 5)],
)
def test_conservation(mode, max_lag, waves):
    steps, per_step = 7, SMALL["samples_per_step"]
    r = simulate(mode, 8, 24, max_lag, lengths=lognormal(1000, 1.0), steps=steps, warmup=2, wave_groups=waves, **SMALL)
    assert r.samples_trained == steps * per_step
    assert r.samples_started == r.samples_trained + r.samples_in_flight
    # At most max_lag steps of groups queued plus the step in training.
    assert r.samples_in_flight <= (max(max_lag, 1) + 1) * per_step


def test_the_trainers_busy_time_is_the_windows_steps_and_no_step_after_it():
    """A generator-bound pipeline: its trainer is busy for each step the window measures (the
    step's tokens, the optimizer step, the weights sent), and for no step begun after the window
    closed (which would count in the busy time and in the lag)."""
    r = simulate("pipeline", 4, 28, 2, lengths=lognormal(1000, 0.0), steps=7, warmup=2, **SMALL)
    per_step = H100.train_s(512 * (1000 + 100), 28) + H100.optimizer_step_s + H100.weight_sync_s
    assert r.train_busy == pytest.approx(5 * per_step / r.window_s) and r.train_busy < 0.9


def test_filtered_groups_are_generated_and_not_trained():
    # Zero-variance groups free their admission slot when they finish, so the engine generates
    # replacements: about 1 / (1 - f) groups per trained one, and a longer sync step.
    lengths = lognormal(1000, 0.5)
    plain = simulate("sync", 8, 24, 0, lengths=lengths, steps=20, warmup=2, **SMALL)
    filtered = simulate("sync", 8, 24, 0, lengths=lengths, steps=20, warmup=2, filtered=0.4, **SMALL)
    assert filtered.samples_trained == plain.samples_trained == 20 * SMALL["samples_per_step"]
    done = filtered.samples_started - filtered.samples_in_flight
    assert done == filtered.samples_trained + filtered.samples_filtered
    assert filtered.samples_filtered / done == pytest.approx(0.4, abs=0.05)
    assert plain.samples_filtered == 0 and filtered.step_s > 1.2 * plain.step_s
    # The calibration's share is the default; a job without filtering plans with none.
    calib = H100.model_copy(update={"filtered_fraction": 0.4})
    assert simulate("sync", 8, 24, 0, lengths=lengths, steps=20, warmup=2, **SMALL | {"calib": calib}) == filtered
    unfiltered = job(
        model={"path": "Qwen/Qwen2.5-7B"},
        rl={"attempts": 16, "filterZeroVariance": False},
        generator={"gpus": 1},
        trainer={"gpus": 8, "samplesPerStep": 512},
    )
    assert plan(unfiltered, 16, calib).filtered == 0


def test_each_request_stalls_its_engine_for_its_own_cost():
    # Short completions (4 tokens, as the tiny job's): a request's own cost (admission, output
    # handling) outweighs its decode steps, and a generator-bound run slows by it: per engine,
    # attempts * request_s more per group.
    free = ("decode_per_seq_s", "decode_per_token_s", "optimizer_step_s", "weight_sync_s", "pause_s")
    calib = H100.model_copy(update=dict.fromkeys(free, 0.0) | {"train_s_per_token": 1e-9})
    short = Lengths(distribution="empirical", values=[4], prompt_tokens=0)
    args = dict(lengths=short, steps=20, warmup=4, max_running=64, **SMALL | {"calib": calib})
    plain = simulate("pipeline", 4, 4, 4, **args)
    costly = simulate("pipeline", 4, 4, 4, **args | {"calib": calib.model_copy(update={"request_s": 0.002})})
    assert plain.gen_busy > 0.9 and costly.gen_busy < plain.gen_busy
    # An engine's 64 running sequences take 4 steps (4 x 7 ms) and 64 requests (64 x 2 ms).
    per_batch = 4 * calib.decode_base_s
    assert plain.samples_per_s / costly.samples_per_s == pytest.approx((per_batch + 64 * 0.002) / per_batch, rel=0.1)


def test_streamed_steps_hide_training_behind_generation():
    # Balanced stages with a variable generation time (zero-variance filtering): when the trainer
    # waits for a step, waves let it compute most of it while the rest is generated.
    calib = H100.model_copy(update={"filtered_fraction": 0.4})
    lengths = lognormal(1000, 1.0)
    whole = simulate("pipeline", 16, 16, 1, lengths=lengths, steps=30, **SMALL | {"calib": calib})
    waves = simulate("pipeline", 16, 16, 1, lengths=lengths, steps=30, wave_groups=8, **SMALL | {"calib": calib})
    assert waves.samples_per_s > 1.03 * whole.samples_per_s and waves.lag_max <= 1
    # Sync mode, the conventional baseline, trains whole steps whatever is asked.
    sync = simulate("sync", 16, 16, 0, lengths=lengths, steps=30, **SMALL | {"calib": calib})
    assert simulate("sync", 16, 16, 0, lengths=lengths, steps=30, wave_groups=8, **SMALL | {"calib": calib}) == sync


def test_wave_groups_follow_the_preprocessor():
    # The tiny job: 8 samples of 8 + ~4 tokens per group, rows of 512 tokens: four groups fit
    # one row beside a longest sample of 16 tokens (as packing.next_wave forms them).
    tiny = parse_job(yaml.safe_load(open("examples/tiny-cpu.yaml")))
    lengths = Lengths(distribution="empirical", values=[4], prompt_tokens=8)
    assert wave_groups(tiny, 1, lengths) == (512 - 16) // 96 == 5
    assert wave_groups(tiny, 2, lengths) == 2 * (512 - 16) // 96
    assert wave_groups(job(rl={"tokenWeighting": "token"}), 1, lengths) == 0  # needs whole steps
    assert wave_groups(job(trainer={"microBatchTokens": 64}), 1, lognormal(1000, 1.0)) == 1


def test_measured_cpu_calibration_predicts_benchmark_1():
    # bench/calibrate_cpu.py derives it from benchmark 1 (pipeline_vs_sync.json: the tiny job on
    # 1 generator + 1 trainer, pipeline maxLag 1 vs sync); the planner must keep predicting the
    # measured pipeline/sync ratio within 20%.
    measured = Path("bench/results/pipeline_vs_sync.json")
    if not measured.is_file():
        pytest.skip("no benchmark 1 result (run python -m bench.pipeline_vs_sync)")
    calib = load_calibration("cpu-tiny")
    assert calib.source.startswith("measured")
    tiny = dict(samples_per_step=128, attempts=8, calib=calib, max_tokens=8, steps=40, warmup=1)
    waves = wave_groups(parse_job(yaml.safe_load(open("examples/tiny-cpu.yaml"))), 1, calib.lengths)
    pipe = simulate("pipeline", 1, 1, 1, wave_groups=waves, **tiny)
    ratio = pipe.samples_per_s / simulate("sync", 1, 1, 0, **tiny).samples_per_s
    target = json.loads(measured.read_text())["samples_rate_ratio"]["median"]
    assert 0.8 * target <= ratio <= 1.2 * target


def test_deterministic_for_a_seed():
    a = simulate("pipeline", 8, 24, 2, lengths=lognormal(1000, 1.0), seed=3, **SMALL)
    assert a == simulate("pipeline", 8, 24, 2, lengths=lognormal(1000, 1.0), seed=3, **SMALL)
    assert a != simulate("pipeline", 8, 24, 2, lengths=lognormal(1000, 1.0), seed=4, **SMALL)


def test_splits_respect_granularity():
    assert splits(32, 8, 1) == [8, 16, 24]
    assert splits(10, 1, 2) == [2, 4, 6, 8]
    assert splits(2, 1, 2) == []


@pytest.fixture(scope="module")
def paper_plan():
    # A paper-like job on 32 GPUs (4 trainer pods), 512 samples per step, k up to 8: the plan's
    # mechanics at GPU scale in a few seconds (the published setups themselves:
    # test_planner_published.py).
    return plan(paper_job(512), 32, H100, max_k=8)


def test_the_plan_compares_the_pipeline_with_conventional_k_split_and_colocated(paper_plan):
    p = paper_plan
    assert [r.steps_per_generation for r in p.conventional] == [1, 2, 4, 8] == list(ks(8))
    assert [r.steps_per_generation for r in p.colocated] == [1, 2, 4, 8]
    assert all(r.colocated and r.generators == r.trainers == 32 for r in p.colocated)
    assert all(not r.colocated and r.generators + r.trainers == 32 and r.trainers % 8 == 0 for r in p.conventional)
    assert p.sync is p.conventional[0] and p.best_split in p.conventional and p.best_colocated in p.colocated
    assert p.best_split.useful_samples_per_s == max(r.useful_samples_per_s for r in p.conventional)
    # Taking k steps per phase amortises the phase's long tail over k steps: faster with k.
    rates = [r.samples_per_s for r in p.colocated]
    assert rates == sorted(rates) and rates[-1] > 3 * rates[0]
    # Each conventional step j of a phase trains its data at lag j.
    assert [r.lag_max for r in p.conventional] == [0, 1, 3, 7]
    assert p.speedup >= p.speedup_vs_best_split and p.speedup_vs_colocated >= p.speedup_vs_best_colocated
    text = format_plan(p)
    for line in (
        f"vs k = 1  conventional k=1, split ({p.sync.generators} + {p.sync.trainers}): {p.speedup:.2f}x",
        f"vs k = 1  conventional k=1, colocated (32 devices, colocated): {p.speedup_vs_colocated:.2f}x",
        f"vs best k {p.best_split.label} ",
        f"vs best k {p.best_colocated.label} (32 devices, colocated): {p.speedup_vs_best_colocated:.2f}x",
    ):
        assert line in text


def test_paper_like_recommendation_is_sensible(paper_plan):
    p, r = paper_plan, paper_plan.pipeline
    assert r.generators + r.trainers == 32 and r.trainers % 8 == 0
    assert r.max_lag in LAGS and r.lag_mean <= r.max_lag
    # Utilisation is what pipelining buys; a sync phase leaves its generators' batches mostly empty.
    assert r.train_busy > 0.8 and p.sync.gen_fill < 0.5
    # Lag sweep: throughput grows with the lag budget (long completions hold a short one back)
    # and the choice is within tolerance of the best.
    rates = [s.useful_samples_per_s for s in p.lag_sweep]
    assert rates[0] < rates[-1]
    assert r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * max(rates)
    assert p.recommended is p.pipeline and "recommendation: pipeline, maxLag" in format_plan(p)


def test_the_recommendation_is_the_freshest_within_tolerance_of_the_fastest(paper_plan):
    p = paper_plan
    runs = (p.pipeline, *p.conventional)
    top = max(r.useful_samples_per_s for r in runs)
    near = [r for r in runs if r.useful_samples_per_s >= (1 - LAG_TOLERANCE) * top]
    assert p.recommended in near and p.recommended.lag_mean == min(r.lag_mean for r in near)
    fastest = max(p.conventional, key=lambda r: r.useful_samples_per_s)
    slow = dataclasses.replace(p, pipeline=dataclasses.replace(p.pipeline, samples_per_s=0.5 * fastest.samples_per_s))
    assert slow.recommended is fastest  # a pipeline well behind: the fastest conventional k


def test_the_plan_reports_a_range_over_the_inputs_a_team_rarely_knows(paper_plan):
    p = paper_plan
    assert set(p.variants) == set(LENGTH_VARIANTS) | {"TP 2"}  # h100-7b says how its costs scale with TP
    for baseline, point in (("best_split", p.speedup_vs_best_split), ("best_colocated", p.speedup_vs_best_colocated)):
        low, high = p.ratio_range(baseline)
        assert low <= point <= high and high > low  # the inputs move the ratio
    # At the split chosen for the calibration's lengths: twice as long, its generators fall short
    # (the split would have to move), while colocated phases use every device whatever the lengths.
    assert p.variants["mean x2"]["best_colocated"] < p.speedup_vs_best_colocated
    # TP 2 moves the ratio: the same devices make half as many engines, each with a faster step
    # and twice the KV cache.
    assert p.variants["TP 2"]["best_split"] != pytest.approx(p.speedup_vs_best_split, rel=0.01)
    low, high = p.ratio_range("best_colocated")
    assert f"vs best k colocated {low:.2f}-{high:.2f}x" in format_plan(p) and "TP 2)" in format_plan(p)


def test_tensor_parallel_splits_what_streams_and_keeps_what_does_not():
    h = H100
    x = h.tensor_parallel
    assert x is not None and h.gpus_per_engine == 1
    tp2 = at_tensor_parallel(h, 2)
    assert tp2.gpus_per_engine == 2 and tp2.name == "h100-7b at TP 2"
    # The step: its fixed part kept, the weights' stream halved, two all-reduces per layer added.
    assert tp2.decode_base_s == pytest.approx(x.fixed_s + (h.decode_base_s - x.fixed_s) / 2 + x.allreduce_s)
    assert tp2.decode_per_seq_s == pytest.approx(h.decode_per_seq_s / 2)
    assert tp2.decode_per_token_s == pytest.approx(h.decode_per_token_s / 2)
    assert tp2.prefill_s_per_token == pytest.approx(h.prefill_s_per_token / 2)
    # Two devices' memory less one copy of the weights, in KV tokens: more than twice one's.
    assert tp2.kv_cache_tokens > 2 * h.kv_cache_tokens
    # Back to one device: the calibration's own costs.
    back = at_tensor_parallel(tp2, 1)
    for field in ("decode_base_s", "decode_per_seq_s", "decode_per_token_s", "prefill_s_per_token"):
        assert getattr(back, field) == pytest.approx(getattr(h, field)), field
    assert abs(back.kv_cache_tokens - h.kv_cache_tokens) <= 1
    assert at_tensor_parallel(h, 1) is h
    with pytest.raises(ValueError, match=r"n_gen \(7\) must be whole engines of 2 devices"):
        simulate("pipeline", 7, 9, 2, **(SMALL | {"calib": tp2}))
    # Colocated, every device trains and the whole engines generate (8 of 9 devices): the plan's
    # TP-2 variant on an odd device count.
    odd = simulate("sync", 9, 9, 0, colocated=True, **(SMALL | {"calib": tp2}))
    even = simulate("sync", 8, 8, 0, colocated=True, **(SMALL | {"calib": tp2}))
    assert odd.samples_per_s > even.samples_per_s  # one more trainer, the same engines
    tiny_gpu = job(
        model={"path": "Qwen/Qwen2.5-7B", "maxSeqLen": 1024},
        rl={"attempts": 8},
        generator={"gpus": 1, "sampling": {"maxTokens": 256}},
        trainer={"gpus": 1},
    )
    assert "TP 2" in plan(tiny_gpu, 9, h, max_k=2).variants
    with pytest.raises(ValueError, match="no KV cache on 1 device"):
        at_tensor_parallel(tp2.model_copy(update={"tensor_parallel": x.model_copy(update={"weights_bytes": 1e12})}), 1)
    with pytest.raises(ValueError, match="no tensor_parallel scaling"):
        at_tensor_parallel(h.model_copy(update={"tensor_parallel": None}), 2)
    # No scaling given, or a TP that cannot hold the model: no TP variant.
    assert not [n for n in variants_of(h.lengths, h.model_copy(update={"tensor_parallel": None})) if n.startswith("TP")]
    assert [n for n in variants_of(h.lengths, tp2) if n.startswith("TP")] == ["TP 1", "TP 4"]


def test_varied_lengths_scale_the_mean_and_the_spread():
    lognormal = Lengths(mean_tokens=1000, sigma=0.8, prompt_tokens=50)
    assert vary(lognormal, 2.0, 0.5) == Lengths(mean_tokens=2000, sigma=0.4, prompt_tokens=50)
    measured = Lengths(distribution="empirical", values=[3, 10, 40], prompt_tokens=8)
    assert vary(measured, 0.5, 1.0).values == [2, 5, 20] and vary(measured, 1.0, 1.5) is None


def test_k_are_powers_of_two_up_to_the_bound():
    assert ks(1) == (1,) and ks(32) == (1, 2, 4, 8, 16, 32) and ks(40) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError, match="max_k"):
        ks(0)


def test_calibration_round_trip(tmp_path):
    for name in ("h100-7b", "cpu-tiny"):
        calib = load_calibration(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(calib.model_dump(mode="json"), sort_keys=False))
        assert load_calibration(path) == calib
    empirical = Lengths(distribution="empirical", values=[3, 5, 9])
    measured = H100.model_copy(update={"name": "measured", "lengths": empirical})
    path = tmp_path / "measured.json"
    path.write_text(measured.model_dump_json())
    assert load_calibration(path) == measured


def test_builtins_are_package_data():
    # A built-in name reads pipelinerl/calibrations/<name>.yaml and nothing else: the measured
    # CPU costs (bench/calibrate_cpu.py writes them there) ship with the package.
    for name in ("h100-7b", "cpu-tiny"):
        path = CALIBRATIONS / f"{name}.yaml"
        assert load_calibration(name) == parse_calibration(yaml.safe_load(path.read_text())) == load_calibration(path)
    assert load_calibration("cpu-tiny").source.startswith("measured")
    with pytest.raises(CalibrationError, match="built-ins: cpu-long-tail, cpu-tiny, h100-7b"):
        load_calibration("calibration-cpu")


@pytest.mark.parametrize(
    "change,field",
    [
        ({"max_batch": 0}, "max_batch"),
        ({"decode_base_s": None}, "decode_base_s"),
        ({"train_scaling": 1.5}, "train_scaling"),
        ({"trian_s_per_token": 1.0}, "trian_s_per_token"),
        ({"lengths": {"distribution": "lognormal", "sigma": 1.0}}, "mean_tokens"),
        ({"lengths": {"distribution": "empirical", "values": [0, 3]}}, "values"),
    ],
)
def test_bad_calibration_names_the_field(tmp_path, change, field):
    data = H100.model_dump() | change
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(CalibrationError, match=field) as err:
        load_calibration(path)
    assert str(path) in str(err.value)


def test_unknown_calibration_lists_builtins():
    with pytest.raises(CalibrationError, match="h100-7b"):
        load_calibration("a100-70b")
    with pytest.raises(CalibrationError, match="mapping"):
        parse_calibration([1, 2])


def test_cli_plan(capsys, tmp_path):
    assert main(["plan", "examples/tiny-cpu.yaml", "--gpus", "2", "--max-k", "4"]) == 0
    out = capsys.readouterr().out
    assert "recommendation: " in out and "conventional k=4, colocated" in out and "k=8" not in out
    assert "vs k = 1  conventional k=1, split (1 + 1)" in out and "vs best k conventional k=" in out
    assert (
        main(
            [
                "plan",
                "examples/tiny-cpu.yaml",
                "--gpus",
                "3",
                "--json",
                "--mean-tokens",
                "6",
                "--filtered-fraction",
                "0.25",
                "--baseline-logprob-pass",
                "0.25",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["filtered"] == 0.25 and data["baseline_logprob_pass"] == 0.25
    assert data["recommended"]["generators"] + data["recommended"]["trainers"] == 3
    assert data["speedup"] > 0 and len(data["lag_sweep"]) == len(LAGS)
    assert len(data["conventional"]) == len(data["colocated"]) == len(ks(32))

    def useful(r: dict) -> float:
        return r["samples_per_s"] * (1 - r["dropped"])

    assert data["speedup_vs_best_split"] == pytest.approx(useful(data["pipeline"]) / useful(data["best_split"]))
    assert data["best_colocated"]["colocated"] and data["speedup_vs_best_colocated"] > 0
    low, high = data["ratio_range"]["best_colocated"]
    assert low <= data["speedup_vs_best_colocated"] <= high

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "decode_base_s": -1}))
    assert main(["plan", "examples/tiny-cpu.yaml", "--gpus", "2", "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "decode_base_s" in err and "max_batch" in err
    assert main(["plan", "examples/tiny-cpu.yaml", "--gpus", "1"]) == 2
    assert "--gpus 1" in capsys.readouterr().err
