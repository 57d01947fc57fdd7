"""The planner against published results: the PipelineRL paper (arXiv 2509.19128: §5 at 128
and at 32 H100s, appendix A.4's analytic case) and AReaL (arXiv 2505.24298, Table 1, 7B).

Every case runs on ONE cost set, the shipped `h100-7b` calibration (its comments give each
number's derivation: the decode costs measured on an H200 and carried to an H100, the rest from
published hardware and model figures); none is fitted to a case. Each
test writes down its inputs: which are published, which are estimated and from what. The
planner's ratio must be within ±20% of the published one; where it is not, the test names the
effect the model lacks and asserts the planner's current value with a tolerance, so that it
still fails if the model moves (either way).

The ratios are of samples per second in the steady state. So are the PipelineRL paper's (Fig. 5c;
its sides learned as much per sample, Fig. 5b).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelinerl.planner.bound import fit_curve
from pipelinerl.planner.calibration import Lengths, load_calibration
from pipelinerl.planner.sim_params import SimResult
from pipelinerl.planner.simulation import simulate

H100 = load_calibration("h100-7b")
WITHIN = 0.20  # the target: within ±20% of the published ratio


def ratio(pipeline: SimResult, baseline: SimResult) -> float:
    return pipeline.useful_samples_per_s / baseline.useful_samples_per_s


def test_the_decode_costs_are_the_h200_curve_carried_to_an_h100():
    """h100-7b's three decode costs follow from the measured curve (bench/results/gpu_decode.json,
    the grouped attention) and the chips' published HBM bandwidths, as its comments derive them:
    the step's base split into the weights' stream and a part that does not depend on the model's
    size (both shapes have 28 layers), the stream and the KV reads slowed by 3.35 / 4.8 TB/s, the
    per-sequence GEMMs (compute: the same peak) kept."""
    measured = json.loads((Path(__file__).parents[2] / "bench/results/gpu_decode.json").read_text())
    assert measured["device"].startswith("NVIDIA H200")
    curve, weights = {}, {}
    for size in ("1.5B", "7B"):
        model = measured["models"][size]
        points = [p for p in model["points"] if p.get("attention") == "grouped" and "step_s" in p]
        assert len(points) >= 9 and model["agree"] < 1e-4  # the grouped attention computes sdpa's
        curve[size] = fit_curve([(p["batch"], p["context"], p["step_s"]) for p in points])
        weights[size] = model["weights_bytes"]
    stream = (weights["7B"] - weights["1.5B"]) / (curve["7B"].base_s - curve["1.5B"].base_s)  # bytes/s
    fixed = curve["7B"].base_s - weights["7B"] / stream
    slower = 4.8 / 3.35
    assert H100.decode_base_s == pytest.approx(fixed + weights["7B"] / stream * slower, rel=0.01)
    assert H100.decode_per_seq_s == pytest.approx(curve["7B"].per_seq_s, rel=0.01)
    assert H100.decode_per_token_s == pytest.approx(curve["7B"].per_token_s * slower, rel=0.01)
    assert H100.tensor_parallel.fixed_s == pytest.approx(fixed, rel=0.01)


# -- PipelineRL §5: 128 H100, k = 32 ---------------------------------------------------------
# Published (§5 and the reference implementation's config): Qwen2.5-7B, 128 H100s: 48
# generation GPUs at 64 running sequences each (`llm_max_rollouts`) + 80 training GPUs; 1,024
# samples per step; 8,192 max tokens; 8 attempts per prompt (the reference config); the
# baseline: conventional RL with k = 32 optimizer steps per generation phase, every GPU
# generating, then every GPU training (colocated). PipelineRL learned ~2x faster; its max lag
# reached ~49.
# Estimated: completion lengths lognormal, sigma 0.8, mean 600 before clipping: what the
# published max lag implies (48 here; the 32-H100 run's 1.5K gives 19: a sequence of 8,192
# tokens spans ~3 x 8,192 / mean steps of 1,024 samples when 48 x 64 sequences run), 200-token
# prompts (the calibration's); the baseline's engines run at most 64 sequences too (the same
# actor, same `llm_max_rollouts`); the pipeline's lag budget 64 (above the ~49 reached).
PAPER = dict(samples_per_step=1024, attempts=8, calib=H100, max_tokens=8192, max_running=64)
LENGTHS_128 = Lengths(mean_tokens=600, sigma=0.8, prompt_tokens=200)
LAG_128 = 49  # published


def at_128(generators: int = 48, **inputs) -> tuple[SimResult, SimResult]:
    """The pipeline on `generators` of the 128 GPUs (the rest training) and colocated k = 32 on
    all of them, with the paper's inputs (`PAPER`, `LENGTHS_128`, changed by `inputs`)."""
    paper = PAPER | {"lengths": LENGTHS_128} | inputs
    pipeline = simulate("pipeline", generators, 128 - generators, 64, **paper)
    k32 = simulate("sync", 128, 128, 0, steps_per_generation=32, colocated=True, **paper)
    return pipeline, k32


@pytest.fixture(scope="module")
def paper_128():
    return at_128()


def test_paper_128_gpus_against_conventional_k32_colocated(paper_128):
    pipeline, k32 = paper_128
    published = 2.0
    r = ratio(pipeline, k32)
    # MISSES (-38%). The paper's ~2x is of samples per second (Fig. 5c), its reward-per-sample
    # curves for k = 8, 16, 32 and the pipeline indistinguishable (Fig. 5b), so this ratio is the
    # one to compare: learning per sample does not explain the miss. Here the pipeline is
    # trainer-bound: each 1,024-sample step (~3.7 s) carries a 0.3 s optimizer step and the
    # 1.2 s weight update (both estimates, pipelinerl/calibrations/h100-7b.yaml). The ratio
    # hinges on the trainers' time for that update
    # (test_paper_128_gpus_hinges_on_the_weight_update). Also unreproduced: the paper's
    # conventional throughput is itself an estimate (§5: generation on 16 GPUs, 8 batches of
    # 128 x k sequences at 64 running, the longest batch's time taken; training on 16 GPUs,
    # corrected for 8x as many), and its engines are vLLM's, these decode costs a torch decode's.
    assert abs(r / published - 1) > WITHIN
    assert r == pytest.approx(1.25, rel=0.08)
    assert pipeline.train_busy > 0.95 and pipeline.gen_busy < 0.75
    # What the model reproduces: the published max lag (from the lengths it implies), and a mean
    # lag below a k = 32 phase's, whose steps train at lags 0..31.
    assert abs(pipeline.lag_max / LAG_128 - 1) <= WITHIN
    assert pipeline.lag_mean < k32.lag_mean and k32.lag_max == 31


def test_paper_128_gpus_lengths_are_those_its_published_lag_implies():
    """The 32-H100 run's lengths (mean 1.5K, the calibration's: its max lag ~8 is reproduced,
    test_paper_32_gpus_against_conventional_k4_colocated) give the 128-H100 pipeline a max lag of
    ~19 against the published ~49: that run's completions were shorter. Mean 600 gives 48."""
    at_32_gpus_lengths, _ = at_128(lengths=H100.lengths)
    assert at_32_gpus_lengths.lag_max < LAG_128 / 2
    shorter, _ = at_128(lengths=Lengths(mean_tokens=500, sigma=0.8, prompt_tokens=200))
    longer, _ = at_128(lengths=Lengths(mean_tokens=700, sigma=0.8, prompt_tokens=200))
    assert shorter.lag_max > LAG_128 > longer.lag_max


def test_paper_128_gpus_misses_whatever_its_estimated_inputs():
    """The miss is not the estimated inputs': over completion lengths of mean 400-4K tokens and
    sigma 0.5-1.6 (the paper's split), and over splits of 40-72 generation GPUs at 64 or 128
    running sequences per engine (both sides), the ratio stays within 0.78-1.34x, below the
    -20% edge of the published ~2x."""
    cases = [
        at_128(lengths=Lengths(mean_tokens=mean, sigma=sigma, prompt_tokens=200))
        for mean, sigma in [(400, 1.2), (500, 0.5), (500, 1.6), (1000, 1.6), (4000, 0.5), (4000, 1.6)]
    ]
    cases += [at_128(generators, max_running=running) for generators in (40, 56, 72) for running in (64, 128)]
    ratios = [ratio(pipeline, k32) for pipeline, k32 in cases]
    assert 0.7 < min(ratios) and max(ratios) < 2.0 * (1 - WITHIN), ratios


def test_paper_128_gpus_simulates_fast_enough(paper_128):
    # The measuring window spans several lifetimes of the longest sequence (start-up and long
    # tail are out of the rate), at 128 GPUs.
    pipeline, k32 = paper_128
    assert pipeline.window_s >= 3 * pipeline.longest_s
    assert k32.window_s >= k32.step_s * 32  # whole phases


def test_paper_128_gpus_hinges_on_the_weight_update():
    """The estimated cost the ratio turns on: the trainers' time for the weight update after each
    step (the calibration's 1.2 s: ZeRO-3's gather, then NCCL's broadcast, each 15.2 GB at
    ~25 GB/s). The broadcast alone (0.6 s) gives ~1.48x; 0.3 s, within 20% of the published ~2x.
    The engines' pause for it does not count here (the trainers bind): paused only for a staged
    commit, as this project's engines are, the ratio stays 1.25x. Measuring the trainers' update
    at that scale is what would settle the case. (This project's trainers, broadcasting from a
    thread beside the next step, are held up by the gather alone: the 0.6 s case.)"""
    ratios = []
    for update_s in (0.6, 0.3):
        faster = H100.model_copy(update=dict(weight_sync_s=update_s, pause_s=update_s))
        ratios.append(ratio(*at_128(calib=faster)))
    assert ratios[0] == pytest.approx(1.48, rel=0.08)
    assert abs(ratios[1] / 2.0 - 1) <= WITHIN
    staged = H100.model_copy(update=dict(pause_s=0.005))
    assert ratio(*at_128(calib=staged)) == pytest.approx(1.25, rel=0.08)


# -- PipelineRL, the 32-H100 version: k = 4 -------------------------------------------------
# Published: 16 generation + 16 training H100s against conventional k = 4 (colocated, as in
# §5); mean lengths 1-2K of 8K; max lag ~8; ~2x.
# Estimated: 1,024 samples per step and 8 attempts (§5's), 64 running sequences per engine (the
# reference config), lengths as §5.
def test_paper_32_gpus_against_conventional_k4_colocated():
    pipeline = simulate("pipeline", 16, 16, 64, **PAPER)
    k4 = simulate("sync", 32, 32, 0, steps_per_generation=4, colocated=True, **PAPER)
    published = 2.0
    r = ratio(pipeline, k4)
    # Within 20% (1.62: -19%), at the edge: whatever the 128-GPU case lacks (the paper's
    # conventional rate is an estimate) weighs less here, where the k = 4 phase's long tail is
    # amortised over 4 steps only. The pipeline is trainer-bound on 16 trainers; its max lag (8)
    # is the published ~8.
    assert abs(r / published - 1) <= WITHIN
    assert pipeline.train_busy > 0.97 and 6 <= pipeline.lag_max <= 10 and k4.lag_max == 3


# -- PipelineRL appendix A.4: the analytic case ---------------------------------------------
# Published: N = 128 accelerators, B = 128 samples per step, lengths uniform on 1..L; the
# pipeline at 192 running sequences on each of 44 generation accelerators (84 train); the
# conventional baseline at the same max lag, ~133 (k = 134: lags 0..133), every accelerator
# generating B·k / N = 134 sequences, then training; PipelineRL 1.57x.
# Estimated: L = 8,192 (§5's max tokens); no prompts, one attempt per prompt (the analysis counts
# sequences); the pipeline's lag budget left open (its concurrency, 44 x 192, sets the lag).
A4_LENGTHS = Lengths(distribution="empirical", values=list(range(1, 8193)), prompt_tokens=0)
A4 = dict(samples_per_step=128, attempts=1, max_tokens=8192, lengths=A4_LENGTHS)


def a4(calib) -> tuple[SimResult, SimResult]:
    pipeline = simulate("pipeline", 44, 84, 1000, calib=calib, max_running=192, **A4)
    k134 = simulate("sync", 128, 128, 0, calib=calib, steps_per_generation=134, colocated=True, **A4)
    return pipeline, k134


def test_appendix_a4_under_its_own_premises():
    # The analysis' premises (our reading; the appendix's own cost model is not reproduced
    # here): decoding memory-bound, a step's time independent of its batch and contexts (the
    # calibration's base step, 8.88 ms; the ratio does not depend on it); no optimizer or
    # weight-update time; training as fast as the 44 generators at 192 sequences on the 84
    # trainers the appendix gives them.
    step = H100.decode_base_s
    premises = H100.model_copy(
        update=dict(
            decode_per_seq_s=0.0,
            decode_per_token_s=0.0,
            prefill_s_per_token=0.0,
            kv_cache_tokens=None,
            optimizer_step_s=0.0,
            weight_sync_s=0.0,
            pause_s=0.0,
            train_scaling=1.0,
            train_s_per_token=84 * step / (44 * 192),
        )
    )
    pipeline, k134 = a4(premises)
    published = 1.57
    r = ratio(pipeline, k134)
    assert abs(r / published - 1) <= WITHIN  # 1.64: +4%
    # The pipeline's lag: the concurrency (44 x 192 sequences, B = 128, mean length L/2) makes
    # the longest sequence ~133 versions old, as the appendix says.
    assert 120 <= pipeline.lag_max <= 150 and k134.lag_max == 133
    # Measured over several lifetimes of the longest sequence, after the start-up's sequences
    # have all finished. Measured as the planner used to (7 steps after a short warm-up), the
    # start-up (engines filling, lag building) reads the pipeline far slower.
    assert pipeline.window_s >= 3 * pipeline.longest_s
    early = simulate("pipeline", 44, 84, 1000, calib=premises, max_running=192, steps=9, warmup=2, **A4)
    assert ratio(early, k134) < 1.1


def test_appendix_a4_with_the_published_per_gpu_costs():
    pipeline, k134 = a4(H100)
    published = 1.57
    r = ratio(pipeline, k134)
    # MISSES (-53%): under measured-style costs the appendix's premises do not hold, and the
    # planner models what breaks them: (1) a weight update (1.2 s) and an optimizer step
    # (0.3 s) after every 128-sample step load the 84 trainers (busy ~90%, engines idle ~40%),
    # where the analysis has training keep pace; (2) a decode step costs more with more and
    # longer sequences (KV reads, 192 sequences of up to 8k tokens), so the pipeline's full
    # batches lose much of their edge over the baseline's draining ones.
    assert abs(r / published - 1) > WITHIN
    assert r == pytest.approx(0.74, rel=0.08)
    assert pipeline.train_busy > 0.85 and pipeline.gen_busy < 0.7


# -- AReaL (arXiv 2505.24298), Table 1: 7B math -------------------------------------------------
# Published: 2.27x against AReaL's synchronous mode; H800s (the H100's compute and HBM: the same
# cost set); 3/4 of the devices generate; 512 prompts x 16 attempts = 8,192 samples per step;
# 27,648 max generated tokens; max staleness 8 (max lag 8).
# Estimated: 128 devices (16 nodes: the ratio moves with the count, 1.87x at 64 and 2.50x at
# 192); the baseline is AReaL with staleness 0 on the same split (conventional k = 1, split: our
# reading of "its sync mode"); completions of the R1-distilled 7B lognormal with mean 8,000
# tokens, sigma 0.8 (long reasoning on math; not published for the run), 100-token prompts;
# SGLang's batch bounded by the KV cache (the calibration's, ~118 sequences at that length).
AREAL = dict(
    samples_per_step=8192,
    attempts=16,
    calib=H100,
    max_tokens=27648,
    lengths=Lengths(mean_tokens=8000, sigma=0.8, prompt_tokens=100),
)


def test_areal_7b_against_its_sync_mode():
    pipeline = simulate("pipeline", 96, 32, 8, **AREAL)
    sync = simulate("sync", 96, 32, 0, **AREAL)
    published = 2.27
    r = ratio(pipeline, sync)
    assert abs(r / published - 1) <= WITHIN  # 2.18: -4%
    assert pipeline.lag_max <= 8 and pipeline.engine_batch < H100.max_batch  # the KV cache binds
