"""Which trainer checkpoints a pod keeps (pipelinerl_trainer/checkpoint.py `prune`); the whole save
and resume of two pods: tests/integration/test_checkpoint.py."""

from __future__ import annotations


def test_a_checkpoint_the_run_did_not_resume_from_is_not_kept(tmp_path) -> None:
    """Pod A checkpointed step 13 on a stop, pod B did not: the run resumed from 10. A's save of
    step 20 keeps 20 and 10 (where a B that misses this save resumes from), not 13."""
    from pipelinerl_trainer.checkpoint import prune

    for step in (10, 13, 20):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "export").mkdir()
    prune(tmp_path, {20, 10})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "step-10", "step-20"]
