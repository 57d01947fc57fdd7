from pathlib import Path

import pytest
import yaml

from pipelinerl_cli.main import main as cli
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


def test_conventional_k_steps_per_generation():
    k4 = parse_job(job(mode="sync", rl={"stepsPerGeneration": 4}, eval={"interval": 20})).spec
    assert (k4.steps_per_generation, k4.max_lag, k4.waits_for_weights, k4.pending_steps) == (4, 3, True, 4)
    assert not k4.streams_steps
    assert parse_job(job()).spec.steps_per_generation == 1
    sync = parse_job(job(mode="sync")).spec
    assert (sync.steps_per_generation, sync.max_lag, sync.waits_for_weights, sync.pending_steps) == (1, 0, True, 2)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"rl": {"maxLag": -1}}, r"spec\.rl\.maxLag: Input should be greater than or equal to 0"),
        ({"rl": {"loss": "dpo"}}, r"spec\.rl\.loss: Input should be 'reinforce', 'ppo', 'gspo' or 'cispo'"),
        ({"trainer": {"samplesPerStep": 12}}, r"samplesPerStep \(12\) must be a multiple of rl\.attempts \(8\)"),
        ({"mode": "sync", "rl": {"maxLag": 2}}, r"rl\.maxLag must be 0 or unset in sync mode"),
        ({"rl": {"stepsPerGeneration": 4}}, r"rl\.stepsPerGeneration \(4\) applies to sync mode"),
        (
            {"mode": "sync", "rl": {"stepsPerGeneration": 4}, "eval": {"interval": 10}},
            r"eval\.interval \(10\) must be a multiple of rl\.stepsPerGeneration \(4\)",
        ),
        ({"generator": {"sampling": {"maxTokens": 64}}}, r"maxTokens must be smaller than model\.maxSeqLen"),
        ({"trainer": {"microBatchTokens": 16}}, r"microBatchTokens must be at least model\.maxSeqLen"),
        ({"trainr": {}}, r"spec\.trainr: unknown field"),
        ({"generator": {"env": [{"name": "RANK", "value": "3"}]}}, r"env name 'RANK' is reserved"),
        ({"generator": {"sampling": {"temperature": 0}}}, r"temperature: Input should be greater than 0"),
        ({"trainer": {"zeroStage": True}}, r"spec\.trainer\.zeroStage: a ZeRO stage is 0, 1, 2 or 3, not a boolean"),
    ],
)
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
    # labels as the API server checks them (it would refuse the job, and every child it labels)
    for labels, fault in (
        ({"team": "ML Research"}, "not a label value"),
        ({"a/b/c": "x"}, "not a label key"),
        ({"/team": "x"}, "not a label key"),  # an empty prefix
    ):
        with pytest.raises(SpecError, match=rf"metadata\.labels: .*{fault}"):
            parse_job({"metadata": {"name": "x", "labels": labels}})
    assert parse_job({"metadata": {"name": "x", "labels": {"example.com/team": "ml-1", "t": ""}}})
    # a field ObjectMeta does not have (kubectl's strict field validation refuses it); the server's own are read
    with pytest.raises(SpecError, match=r"metadata: lables: unknown field \(did you mean labels\?\)"):
        parse_job({"metadata": {"name": "x", "lables": {"team": "a"}}})
    assert parse_job({"metadata": {"name": "x", "uid": "u", "resourceVersion": "7", "managedFields": []}})
    # generateName alone (kubectl create): named as the API server names it, 5 characters added
    named = parse_job({"metadata": {"generateName": "job-"}}).metadata.name
    assert named.startswith("job-") and len(named) == 9
    with pytest.raises(SpecError, match=r"metadata\.name: .*a generateName at most 30"):
        parse_job({"metadata": {"generateName": "x" * 31}})


def test_cli_validate(tmp_path, capsys):
    good = ROOT / "examples" / "tiny-cpu.yaml"
    assert cli(["validate", str(good)]) == 0
    assert "valid PipelineRLJob 'tiny-arith'" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: pipelinerl.dev/v1alpha1\nkind: PipelineRLJob\nmetadata: {name: x}\nspec:\n  rl: {attempts: 1}\n"
    )
    assert cli(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "spec.rl.attempts: Input should be greater than or equal to 2" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert cli(["validate", str(broken)]) == 2
    assert "cannot read manifest" in capsys.readouterr().err


def test_validate_against_an_old_manifest_that_no_longer_reads_checks_the_update_alone(tmp_path, capsys):
    """As the webhook does (a job stored under rules since tightened can be fixed), saying that
    the fields that cannot change were not compared."""
    head = "apiVersion: pipelinerl.dev/v1alpha1\nkind: PipelineRLJob\nmetadata: {name: x}\n"
    (tmp_path / "old.yaml").write_text(head + "spec:\n  generator: {engineArgs: {no_such_arg: 1}}\n")
    (tmp_path / "new.yaml").write_text(head + "spec: {}\n")
    assert cli(["validate", str(tmp_path / "new.yaml"), "--against", str(tmp_path / "old.yaml")]) == 0
    err = capsys.readouterr().err
    assert "old.yaml no longer reads, so the fields that cannot change were not compared" in err
    assert "engineArgs.no_such_arg" in err


def test_yaml_is_read_as_kubectl_sends_it(tmp_path):
    """1e-6 is a number (YAML 1.2, as kubectl reads it; PyYAML's 1.1 would make it a string), and
    what the project writes it reads back the same (a string that looks like one stays a string)."""
    from pipelinerl.spec import read_manifest

    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: pipelinerl.dev/v1alpha1\nkind: PipelineRLJob\nmetadata: {name: t}\n"
        "spec:\n  trainer: {learningRate: 1e-6, weightDecay: .5e-2}\n"
        "  generator: {env: [{name: X, value: '1e5'}]}\n"
    )
    j = load_job(path)
    assert j.spec.trainer.learning_rate == 1e-6 and j.spec.trainer.weight_decay == 0.005
    assert j.spec.generator.env[0].value == "1e5"
    path.write_text(dump_job(j))
    assert load_job(path) == j and "'1e5'" in path.read_text()
    path.write_text("a: 10\nb: 1.5\nc: v1e5\n")
    assert read_manifest(path) == {"a": 10, "b": 1.5, "c": "v1e5"}


def test_yaml_values_read_as_kubectl_sends_them_json(tmp_path):
    """kubectl reads YAML with go-yaml v2 and sends JSON: `2.0` arrives as 2 (an integer field
    takes it), a date and `1:30` stay strings, a null where the field takes none is pruned by
    the API server; and JSON has no infinity. `validate` reads the same file the same way."""
    from pipelinerl.spec import read_manifest

    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: pipelinerl.dev/v1alpha1\nkind: PipelineRLJob\nmetadata: {name: t, labels:}\n"
        "spec:\n  generator: {replicas: 2.0, env: [{name: T, value: 1:30}, {name: D, value: 2025-01-15}]}\n"
        "  trainer: {maxSteps: 1e4, learningRate: 1.0, env:, gpus: ~, resources: {requests: {cpu: ~, memory: 1Gi}}}\n"
        "  task: {params:}\n"
    )
    j = load_job(path)
    assert j.spec.generator.replicas == 2 and j.spec.trainer.max_steps == 10_000 and j.spec.trainer.learning_rate == 1
    assert [v.value for v in j.spec.generator.env] == ["1:30", "2025-01-15"]
    assert (
        j.spec.trainer.env == [] and j.spec.trainer.gpus == 0 and j.spec.task.params == {} and j.metadata.labels == {}
    )
    assert j.spec.trainer.resources.requests == {"memory": "1Gi"}  # a map's null entry pruned too
    path.write_text(dump_job(j))
    assert load_job(path) == j
    path.write_text("a: 1.5\nb: 1e30\nc: 1:30.5\n")
    assert read_manifest(path) == {"a": 1.5, "b": 1e30, "c": "1:30.5"}
    with pytest.raises(SpecError, match=r"spec.rl.klCoef: Input should be a finite number"):
        parse_job({"metadata": {"name": "t"}, "spec": {"rl": {"klCoef": float("inf")}}})
    with pytest.raises(SpecError, match=r"metadata.name: Field required"):
        parse_job({"metadata": {"name": None}})  # pruned: then missing, as the API server says


@pytest.mark.parametrize(
    "text, sent",
    [
        ("0o17", 15), ("0X1F", 31), ("0B11", 3), ("017", 15), ("09", 9), ("1_000", 1000), ("-0x10", -16),
        ("08.5", 8.5), ("y", True), ("N", False), ("yes", True), ("off", False),
        ("_1", "_1"), ("0b2", "0b2"), ("1:30", "1:30"), ("v1", "v1"),
        ("+.5", 0.5), ("1_e5", 100000), ("-_1", -1), ("0x_", "0x_"), ("1.0e+500", "1.0e+500"),
        ("0x10000000000000000", "0x10000000000000000"), ("99999999999999999999", 10**20), ("=", "="),
        ("!foo bar", "bar"), ("!!bool ON", True), ("!!bool 'No'", False), ("oFF", "oFF"),
    ],
)  # fmt: skip
def test_plain_scalars_read_as_go_yaml_v2_reads_them(text, sent):
    """kubectl reads YAML with go-yaml v2: an integer is Go's (`0o17`, `0X1F`, a leading-zero
    octal; `09` a float, sent as 9), and y/n are booleans; PyYAML's YAML 1.1 read the first
    and last ones as strings. What the project writes it reads back the same."""
    from pipelinerl.spec import dump_yaml, load_yaml

    assert load_yaml(f"a: {text}") == {"a": sent} and type(load_yaml(f"a: {text}")["a"]) is type(sent)
    assert load_yaml(dump_yaml({"a": text})) == {"a": text}


def test_merges_infinities_and_keys_as_kubectl_has_them():
    """Merges (`<<`) as go-yaml v2 makes them: in document order, a later key overwriting, of a
    list of maps the first winning (PyYAML refused every merge here); infinity and NaN refused
    (JSON has none: kubectl fails); a list as a key, and a `!!bool` that is none, refused, as
    kubectl refuses them."""
    from pipelinerl.spec import load_yaml

    text = "x: &x {k: 1, j: 1}\nafter: {k: 2, <<: *x}\nbefore: {<<: *x, k: 2}\nlist: {<<: [*x, {k: 3, m: 3}]}"
    assert load_yaml(text) == {
        "x": {"k": 1, "j": 1}, "after": {"k": 1, "j": 1}, "before": {"k": 2, "j": 1}, "list": {"k": 1, "j": 1, "m": 3}
    }  # fmt: skip
    for bad, why in (
        (".inf", "no infinity or NaN"),
        ("[.nan]", "no infinity or NaN"),
        ("{? [a] : 1}", "key must be"),
        ("!!bool 1", "'1' is not a boolean"),  # go-yaml v2 refuses it; it was read as false
    ):
        with pytest.raises(yaml.YAMLError, match=why):
            load_yaml(f"a: {bad}")


def test_mapping_keys_are_sent_as_json_strings():
    """JSON's keys are strings: kubectl sends `y:` as "true" and `1:` as "1", and two keys that
    come out the same are one given twice."""
    from pipelinerl.spec import load_yaml

    assert load_yaml("y: 1\n3: x\nz: {on: 1}") == {"true": 1, "3": "x", "z": {"true": 1}}
    with pytest.raises(yaml.YAMLError, match="duplicate key '1'"):
        load_yaml('1: a\n"1": b')


def test_every_integer_field_is_bounded():
    """As the API server bounds integers (int64), and lower where a library needs it (seeds)."""
    import typing

    from pydantic import BaseModel

    from pipelinerl.spec import MAX_SEED, PipelineRLJob

    unbounded, seen = [], set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            args = typing.get_args(field.annotation) or (field.annotation,)
            nested = [
                b for a in args for b in (a, *typing.get_args(a)) if isinstance(b, type) and issubclass(b, BaseModel)
            ]
            for sub in nested:
                walk(sub, f"{prefix}{field.alias or name}.")
            bound = [getattr(m, "le", None) or getattr(m, "lt", None) for m in field.metadata]
            if int in args and not any(b is not None and b <= 2**63 - 1 for b in bound):
                unbounded.append(prefix + (field.alias or name))

    walk(PipelineRLJob, "")
    assert unbounded == []
    with pytest.raises(SpecError, match=r"spec\.trainer\.seed: Input should be less than or equal to 2147483647"):
        parse_job(job(trainer={"seed": MAX_SEED + 1}))


def test_prompts_that_leave_no_room_are_refused_and_cut_completions_are_warned(tmp_path, capsys):
    from pipelinerl.prompt_fit import prompt_fit, static_prompt_fit
    from pipelinerl.tasks import make_task
    from pipelinerl.tiny_model import make_tokenizer

    task, tok = make_task("arith"), make_tokenizer()
    longest = max(len(tok.encode(task.train_problem(i).prompt)) for i in range(256))
    assert prompt_fit(task, tok, longest + 4, 4) == ([], [])
    errors, _ = prompt_fit(task, tok, longest, 1)
    assert errors == [
        f"model.maxSeqLen: {longest} leaves no room for a completion: the longest of 512 of the "
        f"task's prompts is {longest} tokens"
    ]
    _, warnings = prompt_fit(task, tok, longest + 4, 6)
    assert warnings and "completions are cut at 4 tokens" in warnings[0]
    assert static_prompt_fit(parse_job(job(model={"path": "/models/qwen"}))) is None  # its tokenizer is unknown here
    path = tmp_path / "job.yaml"
    path.write_text(
        __import__("yaml").safe_dump(job(model={"maxSeqLen": longest + 4}, generator={"sampling": {"maxTokens": 6}}))
    )
    assert cli(["validate", str(path)]) == 0
    assert "warning: spec.generator.sampling.maxTokens: 6 tokens do not fit" in capsys.readouterr().err


def test_an_unknown_field_is_named_with_the_closest_known_one():
    from pipelinerl.spec import SpecError, parse_job

    manifest = {
        "metadata": {"name": "demo"},
        "spec": {"trainr": {}, "trainer": {"max_steps": 3}, "generator": {"sampling": {"temprature": 1.0}}},
    }
    with pytest.raises(SpecError) as err:
        parse_job(manifest)
    said = str(err.value)
    assert "spec.trainr: unknown field (did you mean trainer?)" in said
    assert "spec.trainer.max_steps: unknown field (did you mean maxSteps?)" in said
    assert "spec.generator.sampling.temprature: unknown field (did you mean temperature?)" in said
    with pytest.raises(SpecError, match=r"spec\.zzz: unknown field$"):  # nothing close: no guess
        parse_job({"metadata": {"name": "demo"}, "spec": {"zzz": 1}})


def test_a_built_in_tasks_params_are_its_constructors():
    from pipelinerl.tasks import param_problems

    assert param_problems("arith", {"digits": 3, "carry_out": True}) == []
    assert param_problems("arith", {"digitz": 3}) == [
        "task.params.digitz: unknown for the arith task (did you mean digits? its params: digits, carry_out)"
    ]
    assert [p.split(":")[0] for p in param_problems("dataset", {"train": "a", "_rewards": 1})] == [
        "task.params._rewards"
    ]
    assert param_problems("mypackage.tasks:Mine", {"anything": 1}) == []  # its constructor judges, when built


def test_quantities_read_as_kubernetes_reads_them():
    """E and Ei are units (exa), e3 an exponent; one past what decimal holds is an error, not a crash."""
    from pipelinerl.k8s_types import parse_quantity

    assert parse_quantity("1Ei") == 2**60 and parse_quantity("1E") == 10**18 and parse_quantity("2e3") == 2000
    assert parse_quantity("500m") * 2 == 1 and parse_quantity(16) == 16
    with pytest.raises(ValueError, match="too large for a Kubernetes quantity"):
        parse_quantity("1e1000000")
