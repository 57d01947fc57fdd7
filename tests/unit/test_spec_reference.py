"""The job-field docs are generated from the spec models and committed: a field added, removed or
re-described in pipelinerl/spec.py without regenerating them fails here."""

from pathlib import Path

import pytest

from pipelinerl import spec_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_field_reference_is_the_specs():
    assert (ROOT / "docs" / "job-fields.md").read_text() == spec_reference.reference(), (
        "docs/job-fields.md is stale: run python -m pipelinerl.spec_reference"
    )


def test_the_readmes_field_table_is_the_specs():
    readme = (ROOT / "README.md").read_text()
    assert spec_reference.readme_with_summary(readme) == readme, (
        "README.md's job-field table is stale: run python -m pipelinerl.spec_reference"
    )


def test_every_field_is_listed_with_its_default():
    rows = {path: (kind, default) for path, kind, default, _ in spec_reference.rows()}
    assert rows["rl.stepsPerGeneration"] == ("int", "`1`")
    assert rows["mode"] == ("`pipeline` \\| `sync`", "`pipeline`")
    assert "trainer.learningRate" in rows and "weightSync.staged" in rows
    with pytest.raises(ValueError, match="no generated job-fields block"):
        spec_reference.readme_with_summary("# a README without the block\n")
