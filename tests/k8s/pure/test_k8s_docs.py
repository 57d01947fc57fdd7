"""docs/kubernetes.md says what the code does: the objects it lists are the ones `render()` makes,
under those names; the Kueue and gang labels name the group the pods carry; the immutable fields
are the spec's."""

from __future__ import annotations

import re
from pathlib import Path

from pipelinerl.contracts import KUEUE_POD_GROUP_COUNT_ANNOTATION, KUEUE_POD_GROUP_LABEL, POD_GROUP_LABEL, ROLES
from pipelinerl.spec import IMMUTABLE, parse_job
from pipelinerl_operator.job_policy import JobPolicy
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.render import render

DOC = (Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md").read_text()
JOB = "demo"


def section(title: str) -> str:
    return DOC.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def every_child() -> list[dict]:
    """A job with every optional child: a gang scheduler (PodGroup), a Kueue queue, the install key (Secret)."""
    job = parse_job(
        {
            "metadata": {"name": JOB},
            "spec": {"scheduling": {"schedulerName": "scheduler-plugins-scheduler", "queueName": "team-queue"}},
        }
    )
    policy = JobPolicy(scheduler_names=["scheduler-plugins-scheduler"])  # the platform allows the gang scheduler
    return render(job, "team-a", "uid-1", OperatorConfig(auth_key="k" * 32, policy=policy))


def test_the_objects_listed_are_the_objects_rendered():
    listed = set()
    for kind, name in re.findall(r"^\| (\w+) `([^`]+)` \|", section("What the operator renders"), re.M):
        names = [name.replace("<role>", r) for r in ROLES] if "<role>" in name else [name]
        listed |= {(kind, n.replace("<job>", JOB).replace("<uid8>", "uid-1")) for n in names}
    rendered = {(o["kind"], o["metadata"]["name"]) for o in every_child()}
    assert listed == rendered


def test_the_gang_labels_named_are_those_the_pods_carry():
    text = " ".join(DOC.split("\nScheduling: ", 1)[1].split("\n\n", 1)[0].split())  # the paragraph
    named = dict(re.findall(r"`([\w./-]+): <job>-([\w-]+)`", text))
    assert set(named) == {KUEUE_POD_GROUP_LABEL, POD_GROUP_LABEL}
    objects = every_child()
    trainer = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == f"{JOB}-prl-trainer")
    labels = trainer["spec"]["template"]["metadata"]["labels"]
    for label, suffix in named.items():
        assert labels[label] == f"{JOB}-{suffix}", label
    # The PodGroup the coscheduling paragraph speaks of is that group.
    (group,) = [o for o in objects if o["kind"] == "PodGroup"]
    assert group["metadata"]["name"] == labels[POD_GROUP_LABEL]
    assert f"`{KUEUE_POD_GROUP_COUNT_ANNOTATION}`: trainer pods + 1" in text
    annotations = trainer["spec"]["template"]["metadata"]["annotations"]
    assert annotations[KUEUE_POD_GROUP_COUNT_ANNOTATION] == "2" and group["spec"]["minMember"] == 2  # 1 trainer + 1


def test_the_immutable_fields_listed_are_the_specs():
    sentence = " ".join(DOC.split("Immutable fields: ", 1)[1].split("(", 1)[0].split())
    assert re.findall(r"`([\w.]+)`", sentence) == list(IMMUTABLE)
