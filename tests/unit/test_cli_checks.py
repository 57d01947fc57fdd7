"""`pipelinerl run` checks a manifest as `validate` does, before it starts anything; both check
the model path as far as they can from this machine, deciding by how the path looks."""

from pathlib import Path

import pytest
import yaml

from pipelinerl.tasks import make_task
from pipelinerl.tiny_model import make_tokenizer
from pipelinerl_cli.main import main as cli

CORPUS = Path(__file__).resolve().parents[1] / "k8s" / "manifest_corpus.yaml"


def manifest(tmp_path, **spec) -> str:
    job = {"apiVersion": "pipelinerl.dev/v1alpha1", "kind": "PipelineRLJob", "metadata": {"name": "t"}, "spec": spec}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_run_refuses_what_validate_refuses_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("pipelinerl_cli.local.run_local", lambda *_, **__: pytest.fail("run started the job"))
    task, tok = make_task("arith"), make_tokenizer()
    longest = max(len(tok.encode(task.train_problem(i).prompt)) for i in range(512))
    # A prompt that leaves no room for a completion; a job whose NATS streams no store of the
    # chart's default size holds (run checks with the install validate assumes: the chart's defaults).
    hostage = next(c for c in yaml.safe_load(CORPUS.read_text())["invalid"] if c["id"] == "store-hostage")
    cases = [
        (
            {"model": {"maxSeqLen": longest}, "generator": {"sampling": {"maxTokens": 4}}},
            f"spec.model.maxSeqLen: {longest} leaves no room for a completion",
        ),
        (hostage["spec"], f"spec.{hostage['field']}: the job's NATS streams would reserve"),
    ]
    for spec, why in cases:
        path = manifest(tmp_path, **spec)
        assert cli(["validate", path]) == 2
        refused = capsys.readouterr().err
        assert why in refused
        run_dir = tmp_path / "run"
        assert cli(["run", path, "--run-dir", str(run_dir)]) == 2
        assert capsys.readouterr().err == refused  # the same words
        assert not run_dir.exists()  # nothing was started: no run folder, no nats-server, no service


def test_a_local_model_folder_must_exist_one_only_the_cluster_sees_cannot_be_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # An absolute path may be a volume only the pods mount: validate says it cannot check it ...
    path = manifest(tmp_path, model={"path": "/models/qwen-7b"})
    assert cli(["validate", path]) == 0
    err = capsys.readouterr().err
    assert "warning: spec.model.path: '/models/qwen-7b' is not on this machine" in err
    assert "cannot be checked from here" in err and "PersistentVolumeClaim" in err
    # ... and a local run, which needs it here, refuses it before starting anything.
    assert cli(["run", path, "--run-dir", str(tmp_path / "run")]) == 2
    assert "spec.model.path: no folder '/models/qwen-7b' on this machine" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # A folder that is there must be a model folder.
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    assert cli(["validate", manifest(tmp_path, model={"path": str(tmp_path / "models" / "qwen")})]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_a_model_path_read_by_where_it_runs_is_refused_or_told(tmp_path, capsys, monkeypatch):
    """A relative or ~ path is refused at every door (in a pod it is the image's folder); a hub id
    that names a folder here is that folder to a local run and a hub id to a pod: `run` asks for
    the folder's absolute path before starting anything, `validate` notes it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    (tmp_path / "models" / "qwen" / "config.json").write_text("{}")
    for relative in ("./models/qwen", "~/models/qwen", "work/models/qwen"):
        path = manifest(tmp_path, model={"path": relative})
        for command in (["validate", path], ["run", path, "--run-dir", str(tmp_path / "run")]):
            assert cli(command) == 2
            err = capsys.readouterr().err
            assert "spec.model.path" in err and "give the model folder's absolute path, or a hub id" in err
    path = manifest(tmp_path, model={"path": "models/qwen"})
    assert cli(["validate", path]) == 0
    assert "warning: spec.model.path: 'models/qwen' is a folder here" in capsys.readouterr().err
    assert cli(["run", path, "--run-dir", str(tmp_path / "run")]) == 2
    assert f"give the folder's absolute path ({tmp_path / 'models' / 'qwen'})" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_folder_goes_on_only_with_its_job_and_the_fields_that_cannot_change_as_they_were(
    tmp_path, capsys, monkeypatch
):
    """Re-running in a run's folder resumes it, from its checkpoints, streams and claims: another
    job, or this one with a field the API server would not let change (the model, the task, the
    trainer's ranks...), is refused before anything starts, compared with the job the folder last
    ran (its job.yaml edited in place too); other fields may change, and so may those a local run
    does not read (storage, nats.url). Another job's manifest is not read against its store either."""
    from pipelinerl.spec import dump_job, load_job
    from pipelinerl_cli.local import RAN_JOB

    started = []
    monkeypatch.setattr("pipelinerl_cli.local._run_in", lambda job, *_: started.append(job) or 0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ran = dump_job(load_job(manifest(tmp_path)))
    (run_dir / RAN_JOB).write_text(ran)
    resume = ["--run-dir", str(run_dir)]
    assert cli(["run", manifest(tmp_path, trainer={"maxSteps": 500}, storage={"size": "20Gi"}), *resume]) == 0
    assert started[-1].spec.trainer.max_steps == 500
    assert cli(["run", manifest(tmp_path, task={"name": "chain"}, trainer={"replicas": 2}), *resume]) == 2
    err = capsys.readouterr().err
    assert f"{run_dir} holds this job's run with fields that cannot change" in err
    assert '"name":"arith"' in err and '"name":"chain"' in err and "spec.trainer.replicas: 1 now 2" in err
    # job.yaml in the folder, edited in place and run: compared with what the folder ran
    (run_dir / "job.yaml").write_text(ran.replace("builtin:tiny-arith", "builtin:tiny-chain"))
    assert cli(["run", str(run_dir / "job.yaml"), *resume]) == 2
    assert 'spec.model: {"dtype":"auto","maxSeqLen":64,"path":"builtin:tiny-arith"} now' in capsys.readouterr().err
    other = yaml.safe_load(Path(manifest(tmp_path)).read_text())
    other["metadata"]["name"] = "u"
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert cli(["run", str(tmp_path / "other.yaml"), *resume]) == 2
    assert f"{run_dir} holds the run of job default/t, not default/u: give this one another --run-dir" in (
        capsys.readouterr().err
    )
    assert len(started) == 1
    (run_dir / "nats").mkdir()  # nor is another job's manifest read against the folder's store
    assert cli(["dead-letters", str(tmp_path / "other.yaml"), *resume]) == 2
    assert f"not default/u: name its own: {run_dir / 'job.yaml'}" in capsys.readouterr().err


def test_run_names_the_fields_only_the_operator_acts_on_and_validate_an_output_no_pod_writes(
    tmp_path, capsys, monkeypatch
):
    """A local run leaves the cluster's fields alone (a deadline never fires, limits are not
    applied): it names those the manifest sets, and only those. On a cluster an output.path alone
    is written nowhere (and the trainer volumes are then kept): validate says so, run does not."""
    from pipelinerl.spec import load_job, spec_value
    from pipelinerl_cli.cluster_only import CLUSTER_ONLY, cluster_only_given

    monkeypatch.setattr("pipelinerl_cli.local.run_local", lambda *_, **__: 0)
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
    assert cluster_only_given(load_job(example)) == []
    spec = {
        "suspend": True,
        "runPolicy": {"activeDeadlineSeconds": 600, "backoffLimit": 5},
        "trainer": {"resources": {"limits": {"memory": "8Gi"}}, "maxSteps": 10},
        "output": {"path": str(tmp_path / "out")},
    }
    path = manifest(tmp_path, **spec)
    assert cli(["run", path]) == 0
    err = capsys.readouterr().err
    assert (
        "warning: spec.suspend, spec.runPolicy.activeDeadlineSeconds, spec.trainer.resources: the operator's, on a "
        "cluster; a local run leaves them alone" in err
    )
    assert "output.path" not in err
    assert cli(["validate", path]) == 0
    err = capsys.readouterr().err
    assert "warning: spec.output.path: `pipelinerl run`'s; in a pod the model is written nowhere" in err
    assert "a local run leaves them alone" not in err
    assert cli(["validate", manifest(tmp_path, preprocessor={"gpus": 1})]) == 0
    assert "warning: spec.preprocessor.gpus: the preprocessor uses no GPU" in capsys.readouterr().err
    # a tracker's files in the run directory: on a cluster the trainer's volume, gone with the job where it goes
    path = manifest(tmp_path, tracking={"mlflow": {}}, runPolicy={"checkpointRetention": "Delete"})
    assert cli(["validate", path]) == 0
    assert "warning: spec.tracking.mlflow: written into the trainer's volume, which goes with the job" in (
        capsys.readouterr().err
    )
    assert cli(["run", path]) == 0 and "spec.tracking" not in capsys.readouterr().err
    with_output = load_job(manifest(tmp_path, output={"claimName": "models"}))
    for path in CLUSTER_ONLY:
        spec_value(with_output, path)  # each names a field of the spec (else KeyError)


def test_run_refuses_a_job_with_gpus_before_it_starts_anything(tmp_path, capsys):
    """The local runner places processes on cores, with the CPU builds: a GPU job's processes
    would each fail at their start (after their restarts), or share one GPU."""
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = manifest(tmp_path, model={"path": str(model)}, trainer={"gpus": 2}, generator={"gpus": 1})
    assert cli(["validate", path]) == 0  # a cluster runs it
    capsys.readouterr()
    assert cli(["run", path, "--run-dir", str(tmp_path / "run")]) == 2
    assert "spec.generator.gpus, spec.trainer.gpus: `pipelinerl run` runs every process on this machine's cores" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_validate_checks_the_tiny_job_without_importing_torch():
    """`validate`, and `run` before it starts anything, read the built-in model's names, paths and
    tokenizer only: torch (1.4 s of every start) is imported where a model is built or trained."""
    import json
    import subprocess
    import sys

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
    code = (
        "import json, sys; from pipelinerl_cli.main import main; "
        f"main(['validate', '{example}']); print(json.dumps(list(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "transformers" in modules and "torch" not in modules  # the tokenizer was built, without torch


def test_run_takes_a_payload_its_own_nats_takes_that_the_charts_would_not(tmp_path, capsys, monkeypatch):
    """`pipelinerl run` starts its own NATS with the job's max_payload: the chart's (8 MiB), which
    `validate` holds a job on the install's NATS to, is not its limit."""
    started = []
    monkeypatch.setattr("pipelinerl_cli.local.run_local", lambda job, **_: started.append(job) or 0)
    path = manifest(tmp_path, nats={"maxPayloadMb": 16})
    assert cli(["validate", path]) == 2
    assert "spec.nats.maxPayloadMb: more than the install's NATS takes (8 MiB" in capsys.readouterr().err
    assert cli(["run", path]) == 0 and started[0].spec.nats.max_payload_mb == 16


def test_run_checks_with_the_platforms_policy_where_given_as_validate_does(tmp_path, capsys, monkeypatch):
    """A role's env from a Secret (the run takes it from the shell) passes where the platform's
    policy lists the Secret: `run --policy` checks as `validate --policy` does."""
    started = []
    monkeypatch.setattr("pipelinerl_cli.local.run_local", lambda job, **_: started.append(job) or 0)
    secret = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    path = manifest(tmp_path, trainer={"env": [secret]})
    policy = tmp_path / "values.yaml"
    policy.write_text(yaml.safe_dump({"jobPolicy": {"secrets": ["default/hf-token"]}}))
    for command in (["validate", path], ["run", path]):
        assert cli(command) == 2
        # named where it was written (it reaches the trainer's container in the rendered pod)
        refused = capsys.readouterr().err
        assert "spec.trainer.env[HF_TOKEN].valueFrom.secretKeyRef.name: Secret 'hf-token' is not one jobs" in refused
        assert cli([*command, "--policy", str(policy)]) == 0
    assert len(started) == 1
    # a job's own NATS server: refused where the policy lists none; where it does, run names it as left alone
    path = manifest(tmp_path, nats={"url": "nats://nats.team:4222"})
    policy.write_text(yaml.safe_dump({"jobPolicy": {"natsServers": ["nats.team:4222"]}}))
    assert cli(["run", path]) == 2
    assert "spec.nats.url: nats.team:4222 is not a NATS server jobs may use" in capsys.readouterr().err
    assert cli(["run", path, "--policy", str(policy)]) == 0
    assert "warning: spec.nats.url: the operator's, on a cluster; a local run leaves them alone" in (
        capsys.readouterr().err
    )


def test_run_asking_for_more_cores_than_there_are_says_so_and_starts_nothing(tmp_path, monkeypatch):
    """`--pin-cores` with a core per generator and trainer rank: fewer cores than that is an
    error naming the fix, before the run's folder or its NATS exist (it was a traceback after)."""
    import os

    from pipelinerl.spec import SpecError, load_job
    from pipelinerl_cli.local import run_local

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1})
    job = load_job(manifest(tmp_path, generator={"replicas": 3}))
    with pytest.raises(SpecError, match=r"needs a core per trainer rank and generator \(4\).*--cores default"):
        run_local(job, run_dir=tmp_path / "run", cores="split")
    assert not (tmp_path / "run").exists()


def test_a_second_run_in_a_folder_in_use_is_refused_before_it_starts_anything(tmp_path, capsys):
    """Its own NATS on the same store, and services writing the same checkpoints: refused,
    naming the way out, before its NATS starts."""
    import fcntl

    from pipelinerl.spec import SpecError, load_job
    from pipelinerl_cli.local import run_local

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".run.lock", "a") as held:  # the first run's
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SpecError, match=r"is in use by another `pipelinerl run`"):
            run_local(load_job(manifest(tmp_path)), run_dir=run_dir)
        assert not (run_dir / "nats").exists()
        (run_dir / "nats").mkdir()  # a command opening the run's store is told to ask its NATS
        assert cli(["dead-letters", manifest(tmp_path), "--run-dir", str(run_dir)]) == 2
        assert "ask its NATS instead: --nats" in capsys.readouterr().err
        (run_dir / "metrics.jsonl").write_text("")  # ... and so is a calibration from it
        assert cli(["plan", manifest(tmp_path), "--gpus", "2", "--calibrate-from", str(run_dir)]) == 2
        assert "or --calibrate-from its NATS" in capsys.readouterr().err


def test_a_runs_services_hold_its_folder_until_the_last_has_ended(tmp_path):
    """A runner killed outright leaves its services to wind down (the trainer's stop checkpoint):
    the folder stays in use, its lock held by each service it started, until they have ended."""
    from pipelinerl.contracts import ServiceEnv
    from pipelinerl.spec import SpecError
    from pipelinerl_cli.local import lock_run_dir
    from pipelinerl_cli.supervisor import Cores, Service

    lock = lock_run_dir(tmp_path, "")
    (job := tmp_path / "job.yaml").write_text("not: a job\n")  # the service fails at once, having held it
    service = Service(
        "generator", ServiceEnv("generator"), tmp_path / "g.log", job, Cores(None, 1), held=(lock.fileno(),)
    )
    lock.close()  # the runner gone
    with pytest.raises(SpecError, match="in use by another"):
        lock_run_dir(tmp_path, "")
    assert service.proc.wait(timeout=60) != 0
    lock_run_dir(tmp_path, "").close()  # free once it has ended


def test_a_nats_that_is_not_there_and_a_run_folder_that_is_a_file_are_errors_not_tracebacks(tmp_path, capsys):
    """`--nats` at an address nobody serves fails within NATS_CONNECT_S, naming it (before: nats-py
    tried it for the whole first-connection bound, a minute, then a traceback); a `--run-dir`
    naming a file is an error naming it."""
    import time

    from pipelinerl.ports import free_port

    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert cli(["dead-letters", manifest(tmp_path), "--nats", url]) == 2
    assert time.monotonic() - t0 < 20
    assert f"error: --nats {url}: cannot reach NATS" in capsys.readouterr().err
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert cli(["run", manifest(tmp_path), "--run-dir", str(taken)]) == 1
    assert f"error: [Errno 17] File exists: '{taken}'" in capsys.readouterr().err
