"""A checkpoint reaches the disk before `latest` names it (pipelinerl_trainer/checkpoint.py
`durable`): every file and folder of it is fsynced before the rename that publishes it, so a node
that loses power cannot leave `latest` naming data still in its page cache; and a save a full
volume refuses says so, not only torch's stream writer. The engine here is a
stand-in that writes files as DeepSpeed and Hugging Face would (the real save and resume of two
pods: tests/integration/test_checkpoint.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


class Module(torch.nn.Linear):
    config = type("Config", (), {"_name_or_path": "/nonexistent"})()

    def save_pretrained(self, target: Path, safe_serialization: bool) -> None:
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"weights")


class Engine:
    module = Module(2, 2)

    def zero_optimization_stage(self) -> int:
        return 1

    def save_checkpoint(self, folder: str, tag: str, client_state: dict) -> None:
        (Path(folder) / tag).mkdir(parents=True)
        (Path(folder) / tag / "mp_rank_00_model_states.pt").write_bytes(b"states")


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, Path]]:
    """Every fsync (of the path its descriptor names) and rename (to its target), in order."""
    seen: list[tuple[str, Path]] = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: seen.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")))) or fsync(fd)
    )
    monkeypatch.setattr(os, "replace", lambda a, b: seen.append(("replace", Path(b))) or replace(a, b))
    return seen


def test_every_file_of_a_checkpoint_is_on_disk_before_latest_names_it(tmp_path, events) -> None:
    from pipelinerl_trainer import checkpoint

    checkpoint.save(Engine(), tmp_path, 5, {"step": 5}, rank=0, local_rank=0, previous=0)

    published = events.index(("replace", tmp_path / "latest"))
    synced = {p for kind, p in events[:published] if kind == "fsync"}
    written = {p for p in (tmp_path / "step-5").rglob("*")} | {tmp_path / "step-5"}
    assert written <= synced, sorted(written - synced)
    assert {"ds", "hf", "state.json"} == {p.name for p in (tmp_path / "step-5").iterdir()}
    assert ("fsync", tmp_path / "latest.tmp") in events[:published]
    assert ("fsync", tmp_path) in events[published:]  # the rename itself
    assert checkpoint.latest_step(tmp_path) == 5


def test_an_export_is_on_disk_before_its_name_appears(tmp_path, events) -> None:
    from pipelinerl_trainer import checkpoint

    target = checkpoint.export(Engine(), tmp_path / "export" / "version-3", rank=0)

    published = events.index(("replace", target))
    assert ("fsync", target.with_name("version-3.tmp") / "model.safetensors") in events[:published]
    assert ("fsync", target.parent) in events[published:]


class FullVolumeEngine(Engine):
    def save_checkpoint(self, folder: str, tag: str, client_state: dict) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file data/3")


@pytest.mark.parametrize("free", [0, 1 << 40])
def test_a_checkpoint_a_full_volume_refuses_says_so(tmp_path, monkeypatch, free) -> None:
    import shutil

    from pipelinerl_trainer import checkpoint

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(20 << 30, 20 << 30, free))
    with pytest.raises((OSError, RuntimeError)) as error:
        checkpoint.save(FullVolumeEngine(), tmp_path, 5, {"step": 5}, rank=0, local_rank=0, previous=0)
    if free:  # some other failure: torch's own error, as it was
        assert type(error.value) is RuntimeError and "PytorchStreamWriter" in str(error.value)
    else:
        assert isinstance(error.value, OSError) and "its volume is full (0 MiB free of 20.0 GiB)" in str(error.value)
        assert "spec.storage.size" in str(error.value) and "PytorchStreamWriter" in str(error.value.__cause__)
    assert checkpoint.latest_step(tmp_path) is None
