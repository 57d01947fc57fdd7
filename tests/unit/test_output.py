"""The output folder's best-on-evaluation bookkeeping (pipelinerl_trainer/output.py)."""

from __future__ import annotations

import json

from pipelinerl_trainer.output import BEST_FILE, Output, is_better


def export(path, marker: str) -> None:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text(marker)


def test_better_is_strictly_better() -> None:
    assert is_better(0.1, None) and is_better(0.5, {"accuracy": 0.4})
    assert not is_better(0.4, {"accuracy": 0.4}) and not is_better(0.3, {"accuracy": 0.4})


def test_candidates_are_promoted_or_dropped_as_results_come(tmp_path) -> None:
    out = Output(tmp_path, keep_best=True)
    assert [v for v in range(0, 9) if out.wants_candidate(v, 2)] == [2, 4, 6, 8]  # trained, evaluated versions
    assert out.wants_candidate(7, 2, last=True)  # the final version is evaluated too
    assert not Output(tmp_path, keep_best=False).wants_candidate(2, 2) and not out.wants_candidate(2, 0)
    for version in (2, 4, 6):
        export(out.candidate(version), f"v{version}")
    assert out.evaluated(0, 0.9) is False  # the base model has no candidate: never "best"
    assert out.evaluated(2, 0.3) is True
    assert out.evaluated(4, 0.3) is False  # a tie keeps the earlier version
    assert (tmp_path / "best" / "model.safetensors").read_text() == "v2"
    assert [p.name for p in out.candidates.iterdir()] == ["version-6"]  # 4's dropped, 6's still awaited
    assert out.evaluated(6, 0.5) is True
    assert (tmp_path / "best" / "model.safetensors").read_text() == "v6"
    assert json.loads((tmp_path / "best" / BEST_FILE).read_text()) == {"version": 6, "accuracy": 0.5}
    assert list(out.candidates.iterdir()) == [] and not (tmp_path / ".best.old").exists()
    assert Output(tmp_path, keep_best=True).best == {"version": 6, "accuracy": 0.5}  # a restarted trainer keeps it


def test_a_promotion_cut_short_between_its_renames_is_settled_at_the_restart(tmp_path) -> None:
    out = Output(tmp_path, keep_best=True)
    export(out.candidate(2), "v2")
    assert out.evaluated(2, 0.3)
    export(out.candidate(4), "v4")
    # Killed after the best was moved aside, before the candidate took its place: the earlier best is put back.
    (tmp_path / "best").rename(tmp_path / ".best.old")
    restarted = Output(tmp_path, keep_best=True)
    assert restarted.best == {"version": 2, "accuracy": 0.3}
    assert (tmp_path / "best" / "model.safetensors").read_text() == "v2" and not (tmp_path / ".best.old").exists()
    assert not restarted.evaluated(4, 0.2) and (tmp_path / "best" / "model.safetensors").read_text() == "v2"
    # Killed after the candidate took its place, before the earlier best was removed: it is removed.
    export(restarted.candidate(6), "v6")
    assert restarted.evaluated(6, 0.5)
    export(tmp_path / ".best.old", "v2")
    assert Output(tmp_path, keep_best=True).best == {"version": 6, "accuracy": 0.5}
    assert not (tmp_path / ".best.old").exists()


def test_a_promotion_the_disk_refuses_leaves_the_earlier_best_in_place(tmp_path, monkeypatch) -> None:
    """The candidate's rename into best/ refused (a network volume, a quota): the earlier best,
    moved aside, is put back at once (the trainer goes on: nothing settles it at a restart)."""
    import os

    import pytest

    out = Output(tmp_path, keep_best=True)
    export(out.candidate(2), "v2")
    assert out.evaluated(2, 0.3)
    export(out.candidate(4), "v4")
    rename = os.replace

    def refused(src, dst):
        if str(src).endswith("version-4"):
            raise OSError(122, "Disk quota exceeded")
        return rename(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="quota"):
        out.evaluated(4, 0.5)
    assert (tmp_path / "best" / "model.safetensors").read_text() == "v2" and not (tmp_path / ".best.old").exists()


def test_a_trainer_restarted_from_an_evaluated_versions_checkpoint_exports_its_missing_candidate(
    tmp_path, monkeypatch
) -> None:
    """Killed between the checkpoint of an evaluated version and its candidate's export: the
    restart exports it (its evaluation, asked for again, finds it), unless its result was taken
    (the best is that version or a later one). Before, only the final model was made again, and
    the version could never become the best."""
    from types import SimpleNamespace

    from pipelinerl.spec import parse_job
    from pipelinerl_trainer import trainer as t

    exported: list[str] = []
    monkeypatch.setattr(t.checkpoint, "export", lambda engine, path, rank: exported.append(path.name))
    spec = parse_job({"metadata": {"name": "o"}, "spec": {"eval": {"interval": 2}}}).spec
    out = Output(tmp_path, keep_best=True)
    fake = SimpleNamespace(spec=spec, output=out, world=1, rank=0, engine=SimpleNamespace(device="cpu"))
    fake._exports, fake._export_copy = (lambda version: False), (lambda version: tmp_path / "export")
    fake._export_outputs = lambda version, last: t.Trainer._export_outputs(fake, version, last)  # type: ignore[arg-type]

    def restarted_at(version: int, last: bool = False) -> list[str]:
        exported.clear()
        t.Trainer._export_missing(fake, version, last)  # type: ignore[arg-type]
        return list(exported)

    assert restarted_at(4) == ["version-4"] and restarted_at(5) == []  # 5 is not evaluated
    export(out.candidate(4), "v4")
    assert restarted_at(4) == []  # there already
    out.best = {"version": 6, "accuracy": 0.5}
    assert restarted_at(6) == [] and restarted_at(8) == ["version-8"]
    assert restarted_at(9, last=True) == ["version-9", "final"]  # the last version is evaluated too
