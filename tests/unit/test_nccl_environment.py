"""The environment an NCCL weight group's constructor reads: its names are in the environment from a
pod's start, so that setting them around a constructor, beside other threads' native getenv,
only ever replaces a value (`reserve_nccl_environment`)."""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import pytest

from pipelinerl.weight_group import NCCL_DEFAULTS, NCCL_ENVIRONMENT, _environ, reserve_nccl_environment

EXAMPLE = Path(__file__).parents[2] / "examples/tiny-cpu.yaml"


@pytest.fixture
def unset(monkeypatch):
    for name in NCCL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)


def test_a_reserved_environment_is_changed_in_values_only(unset):
    reserve_nccl_environment()
    names = set(os.environ)
    assert {k: os.environ[k] for k in NCCL_DEFAULTS} == NCCL_DEFAULTS
    with _environ(**NCCL_ENVIRONMENT):
        assert set(os.environ) == names
        assert {k: os.environ[k] for k in NCCL_ENVIRONMENT} == NCCL_ENVIRONMENT
    assert set(os.environ) == names
    assert {k: os.environ[k] for k in NCCL_DEFAULTS} == NCCL_DEFAULTS


def test_a_value_the_pod_was_given_is_kept(unset, monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")  # the operator of the cluster wants it everywhere
    reserve_nccl_environment()
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1"


@pytest.mark.parametrize("role", ["generator", "trainer"])
def test_a_pod_entrypoint_reserves_the_names_before_it_starts_its_service(unset, monkeypatch, role):
    from pipelinerl_cli.main import _service

    seen: dict[str, str | None] = {}

    def main(job, env) -> int:
        seen.update({k: os.environ.get(k) for k in NCCL_ENVIRONMENT})
        return 3

    service = types.ModuleType(f"pipelinerl_{role}.main")
    service.main = main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, service.__name__, service)
    assert _service(argparse.Namespace(role=role, job=str(EXAMPLE))) == 3
    assert seen == NCCL_DEFAULTS
