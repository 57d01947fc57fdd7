"""The platform's job policy (pipelinerl_operator/job_policy.py, checked by policy_checks.py): the
chart's values reach the operator as they are, `validate --policy` computes the same settings from
them (config.py), and its allowlists mean what they say. (The hostile-author corpus runs it
through every door: tests/k8s/pure/test_k8s_corpus.py.)"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import helm_python as helm
import kopf
import pytest
import yaml

from chart import CHART, render as render_chart
from pipelinerl.contracts import OperatorEnv
from pipelinerl.spec import load_job, parse_job
from pipelinerl_cli.main import main as cli
from pipelinerl_operator.handlers import operator_config, validate_job
from pipelinerl_operator import config
from pipelinerl_operator.admission import MAX_MANIFEST_BYTES
from pipelinerl_operator.job_policy import JobPolicy, PolicyError, parse_policy, values_schema
from pipelinerl_operator.policy_checks import repository
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.render import RenderError, render

ROOT = Path(__file__).resolve().parents[3]
GPU_EXAMPLE = ROOT / "examples" / "gpu-qwen-math.yaml"


def chart_env(values: dict) -> dict[str, str]:
    """The operator's environment as the chart renders it (plain values only)."""
    operator = next(o for o in render_chart(values) if o["kind"] == "Deployment")
    return {e["name"]: e["value"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}


def admitted(manifest: dict, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The webhook's answer for an operator started with `env`: None (admitted) or its refusal."""
    for name in (OperatorEnv.JOB_POLICY, OperatorEnv.INSTALL_SECRETS):
        monkeypatch.setenv(name, env[name])
    try:
        validate_job(body=manifest, old=None, operation="CREATE")
    except kopf.AdmissionError as err:
        return str(err)
    return None


def test_the_charts_policy_is_the_operators_safe_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert parse_policy(values["jobPolicy"]) == JobPolicy()
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["jobPolicy"] == values_schema(), "regenerate values.schema.json's jobPolicy"


@pytest.mark.parametrize(
    "bad",
    [
        {"secrets": ["hf-token"]},  # no namespace
        {"volumeClaims": ["team-a/models/x"]},
        {"images": ["fluent"]},  # no registry host
        {"natsServers": ["nats.example"]},  # no port
        {"natsServers": [{"server": "nats.example", "cidrs": ["10.0.0.0/8"]}]},
        {"natsServers": [{"cidrs": ["10.0.0.0/8"]}]},  # no server
        {"namespaceShare": 2},
        {"maxPodResources": {"cpu": "lots"}},
        {"tolerations": [{"effect": "NoSchedule"}]},  # no key
        {"nodeSelector": {}},  # a typo
    ],
)
def test_helm_refuses_a_policy_the_operator_would_refuse(bad: dict) -> None:
    with pytest.raises(PolicyError):
        parse_policy(bad)
    with pytest.raises(helm.HelmError):
        helm.Chart.load(str(CHART)).render({"jobPolicy": bad}, name="rl", namespace="team-a")


def test_the_chart_gives_the_operator_its_policy_and_its_own_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU example needs a claim and a priority class: refused by the chart's default, admitted
    with the platform values it comes with. And the install's own Secret (auth.existingSecret
    here) is refused even where the policy lists every Secret."""
    example = yaml.safe_load(GPU_EXAMPLE.read_text())
    example["metadata"]["namespace"] = "team-a"
    refusal = admitted(example, chart_env({}), monkeypatch)
    assert refusal is not None
    assert "spec.scheduling.priorityClassName: 'training' is not a priority class jobs may use" in refusal
    assert "spec.trainer.podTemplate.spec.volumes[models].persistentVolumeClaim.claimName" in refusal
    platform = yaml.safe_load((ROOT / "examples" / "platform-values.yaml").read_text())
    assert admitted(example, chart_env(platform), monkeypatch) is None

    env = chart_env({"auth": {"existingSecret": "team-install-key"}, "jobPolicy": {"secrets": ["*/*"]}})
    assert "team-install-key" in env[OperatorEnv.INSTALL_SECRETS].split(",")
    thief = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "thief", "namespace": "team-a"},
        "spec": {
            "trainer": {
                "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "team-install-key", "key": "key"}}}]
            }
        },
    }
    refusal = admitted(thief, env, monkeypatch)
    assert refusal and "Secret 'team-install-key' is the PipelineRL install's own: no job may use it" in refusal
    thief["spec"]["trainer"]["env"][0]["valueFrom"]["secretKeyRef"]["name"] = "hf-token"
    assert admitted(thief, env, monkeypatch) is None  # any other Secret: listed ("*/*")


def test_validate_takes_the_platforms_values_file_and_the_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["validate", str(GPU_EXAMPLE)]) == 2  # the safe default: refused
    assert "jobPolicy.priorityClassNames: none" in capsys.readouterr().err
    values = str(ROOT / "examples" / "platform-values.yaml")
    assert cli(["validate", str(GPU_EXAMPLE), "--policy", values]) == 2  # team-a's claim, not default's
    assert "not one jobs in default may use" in capsys.readouterr().err
    assert cli(["validate", str(GPU_EXAMPLE), "--policy", values, "-n", "team-a"]) == 0


def test_validate_holds_the_install_the_webhook_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`validate --policy values.yaml` checks with the settings the chart gives the webhook for
    those values: the install's own Secrets, named by its values (auth.existingSecret,
    nats.routesExistingSecret), are refused even where the policy lists every Secret, in the
    webhook's words."""
    values = {
        "auth": {"existingSecret": "team-install-key"},
        "nats": {"routesExistingSecret": "team-routes"},
        "jobPolicy": {"secrets": ["*/*"]},
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    env = chart_env(values)
    for name in ("team-install-key", "team-routes", "hf-token"):
        thief = {
            "apiVersion": "pipelinerl.dev/v1alpha1",
            "kind": "PipelineRLJob",
            "metadata": {"name": "thief", "namespace": "team-a"},
            "spec": {"trainer": {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": name, "key": "key"}}}]}},
        }
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(thief))
        code = cli(["validate", str(tmp_path / "job.yaml"), "--policy", str(tmp_path / "values.yaml")])
        err = capsys.readouterr().err
        refusal = admitted(thief, env, monkeypatch)
        if name == "hf-token":  # any other Secret: listed ("*/*"), at both doors
            assert code == 0 and refusal is None, err
            continue
        assert code == 2
        assert f"env[K].valueFrom.secretKeyRef.name: Secret {name!r} is the PipelineRL install's own: no job" in err
        assert refusal is not None
        said = [line.strip() for line in err.splitlines() if line.startswith("  ")]
        assert said == [line.strip() for line in refusal.splitlines() if line.startswith("  ")], (err, refusal)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {  # maps merge over the chart's defaults key by key (lists are replaced whole)
            "auth": {"existingSecret": "team-install-key"},
            "nats": {"routesExistingSecret": "team-routes", "replicas": 3, "storageGi": 5},
            "jobPolicy": {
                "nodeLabels": {"pool": ["cpu"]},
                "maxPodResources": {"cpu": "8"},
                "dns": {"cidrs": ["169.254.20.10/32"]},
                "secrets": ["team-a/hf-token"],
                "maxJobStoreGi": 2,
            },
        },
        {  # a null deletes a default
            "jobPolicy": {"nodeLabels": {"kubernetes.io/os": None}, "maxPodResources": {"nvidia.com/gpu": None}},
            "metricsNamespaces": ["monitoring"],
            "jobEgress": "open",
            "acknowledgeInsecure": True,
        },
        {
            "nats": {"enabled": False, "externalUrl": "nats://nats.shared:4333", "externalCidrs": ["10.9.0.0/16"]},
            "services": {"image": {"repository": "registry.corp/pipelinerl-services", "digest": "sha256:" + "a" * 64}},
            "auth": {"enabled": False},
            "acknowledgeInsecure": True,
        },
        yaml.safe_load((ROOT / "examples" / "platform-values.yaml").read_text()),
    ],
)
def test_validate_builds_the_settings_the_chart_gives_the_operator(values: dict) -> None:
    """config.chart_env mirrors the chart's templates: the operator's settings from the
    environment Helm renders equal those `validate --policy` computes from the same values (the
    install key and the release namespace aside: no values hold them)."""
    rendered = config.from_env(chart_env(values))
    mirrored = config.from_env(config.chart_env(values, release="rl", namespace="team-a"))
    assert mirrored == rendered
    key = config.KEY_STANDIN if values.get("auth", {}).get("enabled", True) else None
    assert config.from_values(values, release="rl", namespace="team-a") == replace(rendered, auth_key=key)


def test_the_mirrored_chart_defaults_are_the_charts() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, default in config.CHART_DEFAULTS.items():
        if key == "jobPolicy":
            assert parse_policy(default) == parse_policy(values[key])
        elif isinstance(default, dict):
            assert {k: values[key][k] for k in default} == default, key
        else:
            assert values[key] == default, key
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert config.VALUES_KEYS == set(schema["properties"])


def job(name: str = "demo", **spec):
    return parse_job({"metadata": {"name": name, "namespace": "team-a"}, "spec": spec})


def network_policy(cfg: OperatorConfig, **spec) -> dict:
    return next(o for o in render(job(**spec), "team-a", "u", cfg) if o["kind"] == "NetworkPolicy")["spec"]


def test_an_authors_egress_is_rendered_within_the_platforms() -> None:
    policy = parse_policy(
        {
            "egress": [
                {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8", "169.254.0.0/16"], "ports": [{"port": 443}]},
                {"cidr": "192.0.2.0/24", "ports": [{"port": 8000, "endPort": 9000}]},
                {"cidr": "2001:db8::/32"},  # any port
            ]
        }
    )
    cfg = OperatorConfig(policy=policy)
    rules = [
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["198.51.100.0/24"]}}], "ports": [{"port": 443}]},
        {"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"ipBlock": {"cidr": "8.8.8.8/32"}}], "ports": [{"port": 443}]},
        {"to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}], "ports": [{"port": 8080, "endPort": 8090, "protocol": "TCP"}]},
        {"to": [{"ipBlock": {"cidr": "2001:db8:1::/48"}}], "ports": [{"port": 22, "protocol": "TCP"}]},
    ]
    with pytest.raises(RenderError) as err:  # the second: 10/8 is excepted
        render(job(network={"egress": rules}), "team-a", "u", cfg)
    assert [p.split(":")[0] for p in err.value.problems] == ["network.egress.1"]
    del rules[1]
    listed = network_policy(cfg, network={"egress": rules})["egress"][3:]
    assert listed == [
        {
            "to": [
                {
                    "ipBlock": {
                        "cidr": "0.0.0.0/0",
                        "except": [
                            "198.51.100.0/24",
                            "10.0.0.0/8",
                            "169.254.0.0/16",
                            "0.0.0.0/8",
                            "224.0.0.0/4",
                            "240.0.0.0/4",
                        ],
                    }
                }
            ],
            "ports": [{"port": 443}],
        },  # fmt: skip
        {"to": [{"ipBlock": {"cidr": "192.0.2.7/32"}}], "ports": [{"port": 8080, "endPort": 8090, "protocol": "TCP"}]},
        {"to": [{"ipBlock": {"cidr": "2001:db8:1::/48"}}], "ports": [{"port": 22, "protocol": "TCP"}]},
    ]
    with pytest.raises(RenderError):  # a range reaching past the platform's
        render(
            job(network={"egress": [{"to": rules[1]["to"], "ports": [{"port": 8999, "endPort": 9001}]}]}),
            "team-a",
            "u",
            cfg,
        )


def test_ipv6_reaches_no_ipv4_address_the_policy_excepts() -> None:
    """IPv4 space written as IPv6 (IPv4-mapped, NAT64's well-known prefix, 6to4, IPv4-compatible)
    is excepted on IPv6 rules as the policy excepts it on IPv4: refused when asked for alone,
    excepted when inside a larger block; Teredo and local NAT64 always."""
    import ipaddress

    from pipelinerl_operator.egress import embedded

    metadata = ipaddress.ip_address("169.254.169.254")
    forms = embedded(ipaddress.IPv4Network("169.254.169.254/32"))
    assert [str(f) for f in forms] == [
        "::ffff:a9fe:a9fe/128",
        "64:ff9b::a9fe:a9fe/128",
        "::a9fe:a9fe/128",
        "2002:a9fe:a9fe::/48",
    ]
    assert ipaddress.IPv6Address("::ffff:169.254.169.254").ipv4_mapped == metadata
    assert ipaddress.IPv6Address("2002:a9fe:a9fe::1").sixtofour == metadata
    cfg = OperatorConfig()  # the safe default: public addresses on 443
    for cidr in ("::ffff:10.1.2.3/128", "64:ff9b::c0a8:0/112", "2002:ac10::/28", "2001::/32", "64:ff9b:1::/64"):
        with pytest.raises(RenderError):
            render(
                job(network={"egress": [{"to": [{"ipBlock": {"cidr": cidr}}], "ports": [{"port": 443}]}]}),
                "t",
                "u",
                cfg,
            )
    rendered = network_policy(
        cfg, network={"egress": [{"to": [{"ipBlock": {"cidr": "::/0"}}], "ports": [{"port": 443}]}]}
    )
    excepts = {ipaddress.ip_network(e) for e in rendered["egress"][3]["to"][0]["ipBlock"]["except"]}
    for v4 in ("10.0.0.0/8", "169.254.0.0/16", "127.0.0.0/8", "240.0.0.0/4"):
        assert set(embedded(ipaddress.IPv4Network(v4))) <= excepts, v4
    # A public address written as NAT64 (how IPv6-only clusters reach IPv4) stays reachable.
    public = {"to": [{"ipBlock": {"cidr": "64:ff9b::808:808/128"}}], "ports": [{"port": 443}]}
    assert network_policy(cfg, network={"egress": [public]})["egress"][3] == public


def test_the_charts_external_nats_is_reachable_under_restricted_egress() -> None:
    """nats.enabled false: job pods reach nats.externalUrl on its port (at nats.externalCidrs where
    given), not the chart's NATS pods (there are none); and get no NATS credentials (its accounts
    are not the operator's to write), still their weight token."""
    cfg = OperatorConfig(auth_key="k", nats_bundled=False, nats_url="nats://nats.shared.example:4333")
    rendered = render(job(), "team-a", "u", cfg)
    spec = next(o for o in rendered if o["kind"] == "NetworkPolicy")["spec"]
    assert spec["egress"][1] == {"ports": [{"port": 4333, "protocol": "TCP"}]}
    fenced = OperatorConfig(nats_bundled=False, nats_url=cfg.nats_url, nats_external_cidrs=("10.9.0.0/16",))
    assert network_policy(fenced)["egress"][1] == {
        "ports": [{"port": 4333, "protocol": "TCP"}],
        "to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}],
    }
    env = {
        e["name"]
        for o in rendered
        if o["kind"] == "StatefulSet"
        for e in o["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert "PIPELINERL_NATS_PASSWORD" not in env and "PIPELINERL_WEIGHTS_TOKEN" in env
    # The chart says which: its own NATS, or an external one at these addresses.
    external = chart_env(
        {
            "nats": {
                "enabled": False,
                "externalUrl": "nats://nats.shared.example:4333",
                "externalCidrs": ["10.9.0.0/16"],
            },
            "acknowledgeInsecure": True,
        }
    )
    assert external[OperatorEnv.NATS_BUNDLED] == "false" and external[OperatorEnv.NATS_EXTERNAL_CIDRS] == "10.9.0.0/16"


def test_allowlists_mean_what_they_say() -> None:
    assert repository("busybox") == "docker.io/library/busybox"
    assert repository("fluent/fluent-bit:3.0") == "docker.io/fluent/fluent-bit"
    assert repository("localhost:5000/x@sha256:" + "a" * 64) == "localhost:5000/x"
    assert repository("ghcr.io/pipelinerl/services:0.1") == "ghcr.io/pipelinerl/services"

    def refused(cfg: OperatorConfig, **spec) -> list[str]:
        try:
            render(job(**spec), "team-a", "u", cfg)
        except RenderError as err:
            return err.problems
        return []

    claim = {
        "trainer": {
            "podTemplate": {"spec": {"volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": "models"}}]}}
        }
    }
    for listed, ok in ((["team-a/models"], True), (["*/models"], True), (["team-a/*"], True), (["team-b/*"], False)):
        assert (refused(OperatorConfig(policy=parse_policy({"volumeClaims": listed})), **claim) == []) is ok, listed
    taints = OperatorConfig(policy=parse_policy({"tolerations": [{"key": "dedicated", "effect": "NoSchedule"}]}))
    tolerate = lambda t: {"trainer": {"podTemplate": {"spec": {"tolerations": [t]}}}}  # noqa: E731
    assert refused(taints, **tolerate({"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"})) == []
    assert refused(
        taints, **tolerate({"key": "dedicated", "operator": "Exists"})
    )  # every effect of it: more than listed
    # Job labels the operator sets from the spec never reach the pods from the job's metadata.
    labelled = parse_job(
        {
            "metadata": {
                "name": "demo",
                "labels": {
                    "team": "a",
                    "kueue.x-k8s.io/priority-class": "urgent",
                    "scheduling.x-k8s.io/pod-group": "x",
                },
            },
            "spec": {},
        }
    )
    pod = next(o for o in render(labelled, "team-a", "u", OperatorConfig()) if o["kind"] == "StatefulSet")
    labels = pod["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "a" and not [k for k in labels if k.startswith(("kueue.", "scheduling.x-k8s.io"))]


def test_a_manifest_too_large_to_check_cheaply_is_refused_at_every_door(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "demo", "namespace": "team-a"},
        "spec": {"task": {"params": {"blob": "x" * MAX_MANIFEST_BYTES}}},
    }
    with pytest.raises(kopf.AdmissionError, match="more than a job may be"):
        validate_job(body=manifest, old=None, operation="CREATE")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    assert cli(["validate", str(tmp_path / "job.yaml")]) == 2
    assert "more than a job may be" in capsys.readouterr().err


def test_the_webhook_measures_the_manifest_as_validate_does_not_what_the_server_added() -> None:
    """An update of a large job carries two more copies of it in annotations (kubectl's
    last-applied-configuration, kopf's last-handled-configuration), managed fields and a status:
    the webhook checks the manifest in them, as `validate` and the operator do, so that a job they
    admit can be applied again (it refused every update of a job past a third of the bound)."""
    manifest = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "demo", "namespace": "team-a"},
        "spec": {"generator": {"env": [{"name": f"NOTE_{i}", "value": "x" * 1400} for i in range(60)]}},
    }
    text = json.dumps(manifest)
    assert MAX_MANIFEST_BYTES * 0.75 < len(text) < MAX_MANIFEST_BYTES

    def stored(suspend: bool) -> dict:
        obj = copy.deepcopy(manifest)
        obj["spec"]["suspend"] = suspend
        obj["metadata"] |= {
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": text,
                "pipelinerl.dev/last-handled-configuration": json.dumps({"spec": manifest["spec"]}),
            },
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": manifest["spec"]}}],
            "uid": "u",
            "resourceVersion": "7",
        }
        obj["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "message": "x" * 4000}]}
        return obj

    validate_job(body=stored(True), old=stored(False), operation="UPDATE")  # admitted: nothing raised


def test_the_operator_fails_loudly_on_a_bad_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OperatorEnv.JOB_POLICY, json.dumps({"secrets": ["hf-token"]}))
    with pytest.raises(PolicyError, match="secrets.0"):
        operator_config()


def test_every_example_validates_under_the_platform_values_it_comes_with(capsys: pytest.CaptureFixture[str]) -> None:
    values = str(ROOT / "examples" / "platform-values.yaml")
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if "kind: PipelineRLJob" in path.read_text():
            assert cli(["validate", str(path), "--policy", values, "-n", "team-a"]) == 0, capsys.readouterr().err
            load_job(path)


def test_only_the_operator_or_a_cluster_admin_drops_the_cleanup_finalizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update that only removes the operator's finalizer would let the job go without its
    streams and StatefulSets deleted: the webhook refuses it from anyone but the operator's own
    service account (the chart gives the operator its name) or a cluster admin."""
    from pipelinerl_operator.handlers import FINALIZER

    operator = next(o for o in render_chart({}) if o["kind"] == "Deployment" and "operator" in o["metadata"]["name"])
    env = {e["name"]: e for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env[OperatorEnv.SERVICE_ACCOUNT]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}
    monkeypatch.setenv(OperatorEnv.SERVICE_ACCOUNT, "rl-pipelinerl-operator")
    monkeypatch.setenv(OperatorEnv.NAMESPACE, "pipelinerl-system")
    stored = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "demo", "namespace": "team-a", "finalizers": [FINALIZER, "other/keep"]},
        "spec": {},
    }
    dropped = json.loads(json.dumps(stored))
    dropped["metadata"]["finalizers"] = ["other/keep"]
    author = {"username": "alice", "groups": ["team-a", "system:authenticated"]}
    with pytest.raises(kopf.AdmissionError, match="metadata.finalizers"):
        validate_job(body=dropped, old=stored, operation="UPDATE", userinfo=author)
    me = {"username": "system:serviceaccount:pipelinerl-system:rl-pipelinerl-operator", "groups": []}
    validate_job(body=dropped, old=stored, operation="UPDATE", userinfo=me)
    validate_job(
        body=dropped, old=stored, operation="UPDATE", userinfo={"username": "root", "groups": ["system:masters"]}
    )
    validate_job(body=stored, old=dropped, operation="UPDATE", userinfo=author)  # adding it back is anyone's


def test_a_policy_address_without_a_prefix_length_is_refused_before_any_networkpolicy_is() -> None:
    """A NetworkPolicy's ipBlock refuses `10.0.0.5`: the policy does first, naming the field
    (every job rendering it would otherwise be ApplyRefused)."""
    for bad, field in (
        ({"egress": [{"cidr": "10.0.0.5"}]}, "egress.0.cidr"),
        ({"natsServers": [{"server": "nats.example:4222", "cidrs": ["10.0.0.5"]}]}, "cidrs.0"),
    ):
        with pytest.raises(PolicyError, match=rf"{field}.*'10.0.0.5' has no prefix length"):
            parse_policy(bad)
    assert parse_policy({"egress": [{"cidr": "10.0.0.5/32"}]}).egress[0].cidr == "10.0.0.5/32"


def test_a_suspension_or_a_resume_is_admitted_whatever_rules_came_since(monkeypatch) -> None:
    """A policy tightened under a job (its output claim no longer allowed): an update of its spec
    is refused, but not its suspension, nor its resume (the operator stops a job whose spec no
    longer reads by its suspension)."""
    import copy

    import kopf

    monkeypatch.setenv(OperatorEnv.JOB_POLICY, json.dumps({"volumeClaims": ["default/models"]}))
    stored = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {"output": {"claimName": "models"}},
    }
    validate_job(body=stored, old=None, operation="CREATE")
    monkeypatch.setenv(OperatorEnv.JOB_POLICY, json.dumps({}))
    suspended = copy.deepcopy(stored)
    suspended["spec"]["suspend"] = True
    validate_job(body=suspended, old=stored, operation="UPDATE")
    validate_job(body=stored, old=suspended, operation="UPDATE")  # resumed
    edited = copy.deepcopy(suspended)
    edited["spec"]["trainer"] = {"maxSteps": 10}
    with pytest.raises(kopf.AdmissionError, match="spec.output.claimName"):
        validate_job(body=edited, old=suspended, operation="UPDATE")


def test_a_job_whose_stored_spec_no_longer_reads_can_be_fixed() -> None:
    """A job stored under rules since tightened (here an engine argument this vLLM no longer
    takes): the update that fixes it is admitted, checked on its own (the CRD's rules hold the
    fields that cannot change); one that keeps the fault is refused, naming it."""
    import copy

    import kopf

    stored = {
        "apiVersion": "pipelinerl.dev/v1alpha1",
        "kind": "PipelineRLJob",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {"generator": {"engineArgs": {"no_such_arg": 1}}},
    }
    fixed = copy.deepcopy(stored)
    fixed["spec"]["generator"] = {}
    validate_job(body=fixed, old=stored, operation="UPDATE")
    still = copy.deepcopy(stored)
    still["spec"]["trainer"] = {"maxSteps": 10}
    with pytest.raises(kopf.AdmissionError, match=r"spec.generator.engineArgs") as refused:
        validate_job(body=still, old=stored, operation="UPDATE")
    assert "(stored)" not in str(refused.value)  # the update's own field, not the stored one's
