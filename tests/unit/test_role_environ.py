"""`pipelinerl run` gives each role its `spec.<role>.env`, as a pod would get it."""

from pipelinerl_cli.supervisor import role_environ, service_environ
from pipelinerl.spec import EnvVar


def env(*entries: dict) -> list[EnvVar]:
    return [EnvVar.model_validate(e) for e in entries]


def test_values_are_given_as_written():
    said: list[str] = []
    out = role_environ(env({"name": "HF_HOME", "value": "/cache"}, {"name": "EMPTY", "value": ""}), {}, said.append)
    assert out == {"HF_HOME": "/cache", "EMPTY": ""}
    assert said == []


def test_secret_refs_come_from_the_shell_or_are_said_unset():
    entries = env(
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
        {"name": "REGION", "valueFrom": {"configMapKeyRef": {"name": "site", "key": "region"}}},
    )
    said: list[str] = []
    out = role_environ(entries, {"WANDB_API_KEY": "k-123", "UNRELATED": "x"}, said.append)
    assert out == {"WANDB_API_KEY": "k-123"}  # nothing else leaks in from the shell
    assert len(said) == 1 and "REGION" in said[0] and "ConfigMap" in said[0] and "export REGION=" in said[0]
    said.clear()
    role_environ(entries[:1], {}, said.append)
    assert "WANDB_API_KEY" in said[0] and "Secret" in said[0]


def test_a_service_gets_the_shell_then_its_role_env_then_the_contract_but_not_the_launchers_wandb_service():
    from pipelinerl.contracts import Env, ServiceEnv

    shell = {"PATH": "/bin", "HF_HOME": "/shell", "WANDB_SERVICE": "2-123-tcp-localhost-4567", Env.RANK: "9"}
    trainer = service_environ(shell, ServiceEnv(role="trainer", rank=1), {"HF_HOME": "/role", Env.RANK: "7"})
    # A W&B service of the launcher would hold a killed trainer's run (its restart: "in use").
    assert "WANDB_SERVICE" not in trainer
    assert trainer["PATH"] == "/bin" and trainer["HF_HOME"] == "/role"  # the role's env over the shell's
    assert trainer[Env.RANK] == "1"  # the contract over both
    assert trainer["OMP_NUM_THREADS"] == "1" and trainer["PYTHONUNBUFFERED"] == "1"
    generator = service_environ(shell, ServiceEnv(role="generator", torch_threads=2), {})
    assert generator["OMP_NUM_THREADS"] == "2" and generator["HF_HOME"] == "/shell"
    assert "OMP_WAIT_POLICY" not in trainer | generator  # OpenMP's own default: its threads spin a while


def test_a_service_on_shared_cores_waits_passively_unless_the_shell_or_its_role_says_otherwise():
    from pipelinerl.contracts import ServiceEnv

    trainer = ServiceEnv(role="trainer", rank=0, torch_threads=2)
    assert service_environ({}, trainer, {}, passive=True)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert service_environ({"OMP_WAIT_POLICY": "ACTIVE"}, trainer, {}, passive=True)["OMP_WAIT_POLICY"] == "ACTIVE"
    assert service_environ({}, trainer, {"OMP_WAIT_POLICY": "ACTIVE"}, passive=True)["OMP_WAIT_POLICY"] == "ACTIVE"
