"""Which trainer checkpoints a pod keeps (pipelinerl_trainer/checkpoint.py `prune`) and resumes from where
its store goes on from an older one; the whole save
and resume of two pods: tests/integration/test_checkpoint.py."""

from __future__ import annotations

import json


def test_a_checkpoint_the_run_did_not_resume_from_is_not_kept(tmp_path) -> None:
    """Pod A checkpointed step 13 on a stop, pod B did not: the run resumed from 10. A's save of
    step 20 keeps 20 and 10 (where a B that misses this save resumes from), not 13."""
    from pipelinerl_trainer.checkpoint import prune

    for step in (10, 13, 20):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "export").mkdir()
    prune(tmp_path, {20, 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "step-10", "step-20"]


def _checkpoints(root, store: str, steps: list[int], latest: int) -> None:
    for step in steps:
        (root / f"step-{step}").mkdir()
        (root / f"step-{step}" / "state.json").write_text(json.dumps({"step": step, "store": store}))
    (root / "latest").write_text(f"step-{latest}")


def test_a_pod_goes_back_to_the_checkpoint_its_store_was_made_to_go_on_from(tmp_path) -> None:
    """A suspended job's store is restored from the newest checkpoint its trainer told; one saved
    on the stop but never told leaves the pods a checkpoint ahead. Each pod resumes from the one
    the store goes on from where it still holds it, and only in the store's lineage."""
    from pipelinerl.messages import StoreIdentity
    from pipelinerl_trainer.checkpoint import step_the_store_goes_on_from

    def store(adopts=None, step=None):
        return StoreIdentity(id="new", created=0.0, adopts=adopts, adopted_step=step)

    _checkpoints(tmp_path, "old", [10, 13], latest=13)
    assert step_the_store_goes_on_from(tmp_path, store("old", 10)) == 10
    assert step_the_store_goes_on_from(tmp_path, store("old", 13)) is None  # the newest: as it is
    assert step_the_store_goes_on_from(tmp_path, store("old", 7)) is None  # not held: StoreLost, as before
    assert step_the_store_goes_on_from(tmp_path, store("other", 10)) is None  # another lineage's store
    assert step_the_store_goes_on_from(tmp_path, store()) is None  # a store made afresh
    (tmp_path / "step-10" / "state.json").write_text(json.dumps({"step": 10, "store": "older"}))
    assert step_the_store_goes_on_from(tmp_path, store("old", 10)) is None  # step 10 was another store's
    (tmp_path / "step-10" / "state.json").unlink()  # a save cut short
    assert step_the_store_goes_on_from(tmp_path, store("old", 10)) is None
    (tmp_path / "latest").unlink()
    assert step_the_store_goes_on_from(tmp_path, store("old", 10)) is None  # no checkpoint: nothing to go back from
