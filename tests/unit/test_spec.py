from pathlib import Path

import pytest

from pipelinerl.cli import main as cli
from pipelinerl.spec import SpecError, dump_job, load_job, parse_job

ROOT = Path(__file__).resolve().parents[2]


def job(**spec):
    return {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": "t"}, "spec": spec}


def test_example_is_valid_and_round_trips():
    j = load_job(ROOT / "examples" / "tiny-cpu.yaml")
    assert j.spec.mode == "pipeline" and j.spec.max_lag == 1 and j.spec.groups_per_step == 16
    again = parse_job(__import__("yaml").safe_load(dump_job(j)))
    assert again == j


def test_effective_max_lag():
    assert parse_job(job()).spec.max_lag == 4
    assert parse_job(job(mode="sync")).spec.max_lag == 0
    assert parse_job(job(rl={"maxLag": 7})).spec.max_lag == 7


@pytest.mark.parametrize("spec, message", [
    ({"rl": {"maxLag": -1}}, r"spec\.rl\.maxLag: Input should be greater than or equal to 0"),
    ({"rl": {"loss": "dpo"}}, r"spec\.rl\.loss: Input should be 'reinforce', 'ppo', 'gspo' or 'cispo'"),
    ({"trainer": {"samplesPerStep": 12}}, r"samplesPerStep \(12\) must be a multiple of rl\.attempts \(8\)"),
    ({"mode": "sync", "rl": {"maxLag": 2}}, r"rl\.maxLag must be 0 or unset in sync mode"),
    ({"generator": {"sampling": {"maxTokens": 64}}}, r"maxTokens must be smaller than model\.maxSeqLen"),
    ({"trainer": {"microBatchTokens": 16}}, r"microBatchTokens must be at least model\.maxSeqLen"),
    ({"trainr": {}}, r"spec\.trainr: unknown field"),
    ({"generator": {"env": [{"name": "RANK", "value": "3"}]}}, r"env name 'RANK' is reserved"),
    ({"generator": {"sampling": {"temperature": 0}}}, r"temperature: Input should be greater than 0"),
])
def test_errors_name_the_field(spec, message):
    with pytest.raises(SpecError, match=message):
        parse_job(job(**spec))


def test_bad_metadata_and_kind():
    with pytest.raises(SpecError, match=r"metadata\.name: must be a DNS-1035 label"):
        parse_job({"metadata": {"name": "Bad_Name"}})
    with pytest.raises(SpecError, match=r"kind: Input should be 'PipelineRLJob'"):
        parse_job({"kind": "Job", "metadata": {"name": "x"}})
    with pytest.raises(SpecError, match="expected a PipelineRLJob mapping"):
        parse_job([1, 2])


def test_cli_validate(tmp_path, capsys):
    good = ROOT / "examples" / "tiny-cpu.yaml"
    assert cli(["validate", str(good)]) == 0
    assert "valid PipelineRLJob 'tiny-arith'" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: pipelinerl.dev/v1alpha1\nkind: PipelineRLJob\nmetadata: {name: x}\n"
                   "spec:\n  rl: {attempts: 1}\n")
    assert cli(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "spec.rl.attempts: Input should be greater than or equal to 2" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert cli(["validate", str(broken)]) == 2
    assert "cannot read manifest" in capsys.readouterr().err
