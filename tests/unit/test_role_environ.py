"""`pipelinerl run` gives each role its `spec.<role>.env`, as a pod would get it."""

from pipelinerl_cli.supervisor import role_environ
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
