"""An update inside the pause with tensor parallelism: each worker says whether it loaded the
version (`receive_weights`: "" where it did). Where some did and others kept theirs, the engine's
shards hold two versions under one label: the generator stops instead of generating on."""

from __future__ import annotations

import pytest

from pipelinerl_generator.engine import one_version


def test_every_worker_loaded_or_every_worker_kept_its_weights() -> None:
    assert one_version(["", ""], 7) == ""
    assert one_version(["timed out", "timed out"], 7) == "timed out"  # the old version on every shard
    assert one_version(["peer gone"], 7) == "peer gone"


def test_some_workers_loaded_the_version_and_others_kept_theirs() -> None:
    with pytest.raises(RuntimeError, match=r"workers \[0, 2\] loaded version 7 while the others kept theirs"):
        one_version(["", "timed out", ""], 7)
