"""bench/calibrate_cpu: the decode cost split into per-step and per-sequence terms from the sync
generation phases at two step sizes (pure: the planner's simulation, no services)."""

from pathlib import Path

import pytest

from bench.calibrate_cpu import job_spec
from bench.decode_fit import MIN_BASE, fit_split, sync_gen_phase
from pipelinerl.planner.calibration import load_calibration

JOB = Path(__file__).resolve().parents[2] / "examples" / "long-tail-cpu.yaml"


def variant(samples_per_step: int):
    return job_spec(
        JOB, {"args": {"set": [f"trainer.samplesPerStep={samples_per_step}"]}, "runs": {"pipeline": [{"max_lag": 4}]}}
    )


def test_two_step_sizes_recover_the_per_step_and_per_sequence_costs(monkeypatch):
    monkeypatch.setattr("bench.decode_fit.SIM_STEPS", 40)  # the same simulation, shorter
    truth = load_calibration("cpu-long-tail").model_copy(update={"decode_base_s": 0.006, "decode_per_seq_s": 2.5e-4})
    big, small = variant(128), variant(32)
    rows = {128: 3760.0, 32: 940.0}
    phases = {n: sync_gen_phase(truth, job, rows[n]) for n, job in ((128, big), (32, small))}
    assert (
        phases[32] > phases[128] / 4 * 1.2
    )  # the per-step term: a quarter of the step takes well over a quarter of the time
    start = truth.model_copy(update={"decode_base_s": 0.02, "decode_per_seq_s": 0.0})
    fitted = fit_split(start, big, rows[128], phases[128], (small, rows[32], phases[32]), hi=0.05)
    assert fitted.decode_base_s == pytest.approx(0.006, rel=0.1)
    assert fitted.decode_per_seq_s == pytest.approx(2.5e-4, rel=0.1)
    # Phases no split can give (the small step slower than a flat cost makes it): refused.
    assert fit_split(start, big, rows[128], phases[128], (small, rows[32], 5 * phases[32]), hi=0.05) is None
    assert MIN_BASE < fitted.decode_base_s


def test_a_built_in_model_not_built_yet_is_built_with_gradients_on(monkeypatch):
    """Sampling runs under no_grad, but a built-in model missing from the cache is trained (its
    warm start) when its path is resolved: that must happen with gradients on (it failed with
    "element 0 of tensors does not require grad" on a fresh cache)."""
    import torch

    from bench import calibrate_cpu

    class Resolved(Exception):
        pass

    seen = []

    def resolve(path):
        seen.append(torch.is_grad_enabled())
        raise Resolved

    monkeypatch.setattr(calibrate_cpu, "resolve_model_path", resolve)
    with pytest.raises(Resolved):
        calibrate_cpu.sampled_lengths(variant(32))
    assert seen == [True]
