"""A checkpoint reaches the disk before `latest` names it (pipelinerl_trainer/checkpoint.py
`durable`): every file and folder of it is fsynced before the rename that publishes it, so a node
that loses power cannot leave `latest` naming data still in its page cache; and a save a full
volume refuses says so, not only torch's stream writer; a volume holds two checkpoints at most,
the one being written included. The engine here is a
stand-in that writes files as DeepSpeed and Hugging Face would (the real save and resume of two
pods: tests/integration/test_checkpoint.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


class Module(torch.nn.Linear):
    config = type("Config", (), {"_name_or_path": "/nonexistent"})()

    def save_pretrained(self, target: Path, safe_serialization: bool, state_dict: dict | None = None) -> None:
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
    assert {"ds", "hf", "state.json", "whole"} == {p.name for p in (tmp_path / "step-5").iterdir()}
    assert ("fsync", tmp_path / "latest.tmp") in events[:published]
    assert ("fsync", tmp_path) in events[published:]  # the rename itself
    assert checkpoint.latest_step(tmp_path) == 5


def test_an_export_is_on_disk_before_its_name_appears(tmp_path, events) -> None:
    from pipelinerl_trainer import checkpoint

    target = checkpoint.export(Engine(), tmp_path / "export" / "version-3", rank=0)

    published = events.index(("replace", target))
    assert ("fsync", target.with_name("version-3.tmp") / "model.safetensors") in events[:published]
    assert ("fsync", target.parent) in events[published:]


def test_publishing_syncs_the_folder_that_names_it_not_what_its_neighbours_hold(tmp_path, events) -> None:
    """The export's parent is another's (locally, the user's own output folder): its entries are
    synced, nothing in them opened (a FIFO there blocked the export for good; a folder of every
    export kept was walked at each one)."""
    from pipelinerl_trainer import checkpoint

    os.mkfifo(tmp_path / "a-fifo")
    (tmp_path / "older" / "deep").mkdir(parents=True)
    (tmp_path / "older" / "deep" / "weights").write_bytes(b"w")
    target = checkpoint.export(Engine(), tmp_path / "version-3", rank=0)
    published = events.index(("replace", target))
    assert [p for kind, p in events[published:] if kind == "fsync"] == [tmp_path]


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
        assert isinstance(error.value, OSError) and "full or over its quota (0 MiB free of 20.0 GiB)" in str(
            error.value
        )
        assert "spec.storage.size" in str(error.value) and "PytorchStreamWriter" in str(error.value.__cause__)
    assert checkpoint.latest_step(tmp_path) is None


class SafetensorsFullEngine(Engine):
    """DeepSpeed's part written; the Hugging Face copy's write refused as safetensors refuses it (its
    error derives from Exception alone)."""

    class SafetensorError(Exception):
        pass

    class Full(Module):
        def save_pretrained(self, target: Path, safe_serialization: bool, state_dict: dict | None = None) -> None:
            target.mkdir(parents=True)
            raise SafetensorsFullEngine.SafetensorError("Error while serializing: I/O error: No space left on device")

    module = Full(2, 2)


def test_a_checkpoint_cut_short_by_a_full_volume_is_removed_and_said_whatever_raised(tmp_path, monkeypatch) -> None:
    """safetensors' own error, not an OSError, is put down to the full volume too, and what the save
    wrote is removed (nothing names it; left, it kept the volume full for the logs and the store)."""
    import shutil

    from pipelinerl_trainer import checkpoint

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(20 << 30, 20 << 30, 0))
    with pytest.raises(OSError, match=r"checkpoint step-5 not written to .*: its volume is full"):
        checkpoint.save(SafetensorsFullEngine(), tmp_path, 5, {"step": 5}, rank=0, local_rank=0, previous=0)
    assert not (tmp_path / "step-5").exists() and checkpoint.latest_step(tmp_path) is None


def test_an_export_a_full_volume_refuses_says_so_and_leaves_no_folder(tmp_path, monkeypatch) -> None:
    import shutil

    from pipelinerl_trainer import checkpoint

    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(20 << 30, 20 << 30, 0))
    target = tmp_path / "output" / "final"
    with pytest.raises(OSError, match=rf"{target} not written: its volume is full.*spec.output's claim"):
        checkpoint.export(SafetensorsFullEngine(), target, rank=0)
    assert not (tmp_path / "output").exists() or not any((tmp_path / "output").iterdir())


def test_a_write_over_its_quota_is_said_so_with_room_left(tmp_path) -> None:
    import errno

    from pipelinerl_trainer import checkpoint

    class OverQuota(Engine):
        def save_checkpoint(self, folder: str, tag: str, client_state: dict) -> None:
            raise RuntimeError("PytorchStreamWriter failed") from OSError(errno.EDQUOT, "Disk quota exceeded")

    with pytest.raises(OSError, match="its volume is full or over its quota"):
        checkpoint.save(OverQuota(), tmp_path, 5, {"step": 5}, rank=0, local_rank=0, previous=0)


class CountingEngine(Engine):
    """Records how many checkpoints the volume holds while each is written (its own included)."""

    held: list[int] = []

    def save_checkpoint(self, folder: str, tag: str, client_state: dict) -> None:
        super().save_checkpoint(folder, tag, client_state)
        self.held.append(len(list(Path(folder).parents[1].glob("step-*"))))


def test_a_volume_holds_two_checkpoints_at_most_even_while_one_is_written(tmp_path) -> None:
    from pipelinerl_trainer import checkpoint

    engine = CountingEngine()
    engine.held = []
    (tmp_path / "step-7" / "ds").mkdir(parents=True)  # one a crash cut short, of a step trained again
    for step, previous in ((5, 0), (7, 5), (9, 7), (11, 9)):
        checkpoint.save(engine, tmp_path, step, {"step": step}, rank=0, local_rank=0, previous=previous)
    assert engine.held == [1, 2, 2, 2]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-11", "step-9"]
    assert checkpoint.latest_step(tmp_path) == 11


class CrashingEngine(Engine):
    def save_checkpoint(self, folder: str, tag: str, client_state: dict) -> None:
        raise KeyboardInterrupt  # the process dies mid-save


def test_a_crash_mid_save_leaves_latest_naming_a_whole_checkpoint_the_run_resumed_from(tmp_path) -> None:
    """This pod saved step 13 on a stop, another pod did not: the run resumed from 10. Making room
    for step 20 deletes 13, so `latest` is pointed back at 10 first: a crash in the save leaves
    this pod resuming from 10, as every pod can."""
    from pipelinerl_trainer import checkpoint

    for step in (10, 13):
        checkpoint.save(
            Engine(), tmp_path, step, {"step": step}, rank=0, local_rank=0, previous=10 if step == 13 else 0
        )
    assert checkpoint.latest_step(tmp_path) == 13
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(CrashingEngine(), tmp_path, 20, {"step": 20}, rank=0, local_rank=0, previous=10)
    assert checkpoint.latest_step(tmp_path) == 10
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-10"]
    assert (tmp_path / "step-10" / "state.json").exists()


def test_zero3_gathers_the_weights_one_parameter_at_a_time_to_write_them(tmp_path, monkeypatch) -> None:
    """Under ZeRO-3 the Hugging Face copy is gathered parameter by parameter (peak device memory:
    the largest one; gathering them all at once needed the whole model on every rank's device),
    and rank 0 writes exactly the model's weights and persistent buffers."""
    import contextlib

    from pipelinerl_trainer import checkpoint

    class Model(torch.nn.Module):
        config = Module.config

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
            self.register_buffer("scale", torch.ones(2))
            self.register_buffer("scratch", torch.zeros(2), persistent=False)

        def save_pretrained(self, target: Path, safe_serialization: bool, state_dict: dict | None = None) -> None:
            target.mkdir(parents=True)
            self.written = state_dict

    class Zero3(Engine):
        module = Model()

        def zero_optimization_stage(self) -> int:
            return 3

    gathered: list[int] = []

    @contextlib.contextmanager
    def full_parameters(engine, params):
        gathered.append(len(params))
        yield

    monkeypatch.setattr(checkpoint, "full_parameters", full_parameters)
    engine = Zero3()
    checkpoint.export(engine, tmp_path / "export" / "version-1", rank=0)
    assert gathered == [1, 1, 1, 1]  # a.weight, a.bias, b.weight, b.bias
    want = {n: t for n, t in engine.module.state_dict().items()}
    assert set(engine.module.written) == set(want) == {"a.weight", "a.bias", "b.weight", "b.bias", "scale"}
    assert all(torch.equal(engine.module.written[n], t) for n, t in want.items())
