"""The built-in models build to the same weights on any machine (seeded, single-threaded,
deterministic kernels), whatever thread count the process had: each benchmark's targets are
points above the warm start, so a warm start that moved with the machine moved every target."""

import subprocess
import sys

import pytest

BUILD = """
import hashlib, sys, torch
from pipelinerl.tiny_model import deterministic_build
torch.set_num_threads(int(sys.argv[1]))  # the machine's own setting: the build must not depend on it
_, model, info = deterministic_build("tiny-arith", progress=lambda _: None, max_steps=12)
digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()
print(digest, torch.get_num_threads())
"""


def build(threads: int) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", BUILD, str(threads)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    digest, after = out.stdout.split()
    assert after == str(threads)  # the process's own setting is given back
    return digest, after


def test_the_warm_start_is_the_same_whatever_the_threads():
    assert build(1)[0] == build(2)[0]


@pytest.mark.slow  # builds builtin:tiny-arith where it is not cached (~2 minutes; the e2e tests need it anyway)
def test_the_built_in_model_warm_starts_to_the_recorded_accuracy():
    """Every benchmark target is points above this warm start: it is what it was when the
    benchmarks' figures were taken, on any machine."""
    from pipelinerl.tiny_model import model_info, resolve_model_path

    info = model_info(resolve_model_path("builtin:tiny-arith", progress=lambda _: None))
    assert (info["warm_start_steps"], info["warm_start_accuracy"]) == (230, 0.296)
