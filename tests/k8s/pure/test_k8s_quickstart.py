"""The README's cluster quick start, run as far as no cluster is needed: each command of its two
blocks read as its tool would read it. The files and Make targets it names exist; the images it
pushes are the ones `make images` tags and the chart renders with the flags given; the names it
waits on are the rendered ones; each job it applies passes `pipelinerl validate` under the
values installed so far, in the namespace given; the GPU example's prerequisites are the ones its
manifest asks for. Every `kubectl` line of the README and docs/kubernetes.md names its namespace."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from chart import render

from pipelinerl.crd import CONDITION_TYPES
from pipelinerl.spec import load_job
from pipelinerl_cli.main import main

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
REGISTRY = "registry.example.com/ml"


def blocks(text: str, heading: str) -> list[list[list[str]]]:
    """The sh blocks of one section, each a list of commands (continuations joined, comments cut)."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    out = []
    for body in re.findall(r"```sh\n(.*?)```", section, re.DOTALL):
        joined = body.replace("\\\n", " ").replace("REGISTRY", REGISTRY)
        out.append([shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()])
    return out


def helm_set(values: dict, assignment: str) -> None:
    """`--set a.b=c,d=e` as Helm reads it (strings and plain keys: all the README uses)."""
    for item in assignment.split(","):
        path, value = item.split("=", 1)
        node = values
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def flag(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        if a in names:
            return args[i + 1]
        for n in names:
            if n.startswith("--") and a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


class QuickStart:
    """What the commands so far have set up: values installed, images pushed, objects rendered."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.values: dict = {}
        self.release: tuple[str, str] | None = None
        self.pushed: dict[str, str] = {}
        self.applied: dict[str, str] = {}  # job name -> file
        tags = (ROOT / "scripts" / "images.sh").read_text()
        self.built = set(re.findall(r'"(localhost/[\w-]+):\$TAG"', tags))

    def objects(self) -> list[dict]:
        assert self.release, "a command before `helm install`"
        return render(self.values, name=self.release[0], namespace=self.release[1])

    def policy_file(self) -> str:
        path = self.tmp / "values.yaml"
        path.write_text(yaml.safe_dump(self.values))
        return str(path)

    def run(self, cmd: list[str]) -> None:
        tool, args = Path(cmd[0]).name, cmd[1:]
        getattr(self, tool.replace("-", "_"))(args)

    def make(self, args: list[str]) -> None:
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
        assert set(args) <= targets, set(args) - targets

    def buildah(self, args: list[str]) -> None:
        assert args[0] == "push", args
        src, dst = args[1], args[2]
        assert src.rsplit(":", 1)[0] in self.built, f"{src}: not an image `make images` builds"
        assert dst.startswith("docker://"), dst
        self.pushed[src.rsplit(":", 1)[0].removeprefix("localhost/")] = dst.removeprefix("docker://")

    def helm(self, args: list[str]) -> None:
        assert args[0] in ("install", "upgrade"), args
        release, chart = args[1], args[2]
        assert (ROOT / chart / "Chart.yaml").exists(), chart
        namespace = flag(args, "-n", "--namespace")
        assert namespace, f"helm {args[0]} without -n"
        if args[0] == "upgrade":
            assert self.release == (release, namespace) and "--reuse-values" in args, args
        else:
            self.values = {}
        self.release = (release, namespace)
        for i, a in enumerate(args):
            if a in ("-f", "--values"):
                self.values = merged(self.values, yaml.safe_load((ROOT / args[i + 1]).read_text()))
        for i, a in enumerate(args):
            if a == "--set":
                helm_set(self.values, args[i + 1])
        objects = self.objects()  # the chart renders with these values (its schema accepts them)
        operator = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-operator"))
        (container,) = [c for c in operator["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        rendered = {"pipelinerl-operator": container["image"], "pipelinerl-services": env["PIPELINERL_SERVICES_IMAGE"]}
        for image, ref in self.pushed.items():
            assert rendered[image] == ref, f"pushed {ref}, the chart runs {rendered[image]}"

    def kubectl(self, args: list[str]) -> None:
        namespace = flag(args, "-n", "--namespace")
        verb = args[0]
        if verb == "get" and args[1] in ("priorityclass", "nodes"):
            return  # cluster-scoped: checked against the manifest by the prerequisites test
        assert self.release and namespace == self.release[1], (
            f"kubectl {' '.join(args)}: not in the install's namespace"
        )
        if verb == "rollout":
            kind, name = args[2].split("/")
            assert kind == "deployment" and any(
                o["kind"] == "Deployment" and o["metadata"]["name"] == name for o in self.objects()
            ), args
        elif verb == "apply":
            file = flag(args, "-f")
            assert main(["validate", str(ROOT / file), "-n", namespace, "--policy", self.policy_file()]) == 0, file
            self.applied[load_job(ROOT / file).name] = file
        elif verb == "wait":
            kind, name = args[1].split("/")
            assert kind == "prl" and name in self.applied, f"waits on {args[1]}, applied {sorted(self.applied)}"
            condition = flag(args, "--for").removeprefix("condition=")
            assert condition in CONDITION_TYPES, condition
        elif verb == "get":
            assert args[1] in ("prl", "pvc", "localqueue"), args

    def pipelinerl(self, args: list[str]) -> None:
        args = [str(ROOT / a) if (ROOT / a).is_file() else a for a in args]
        policy = flag(args, "--policy")
        if policy:  # the values file the block gives, as installed (over what was installed before)
            args[args.index(policy)] = self.policy_file()
        assert main(args) == 0, args


def test_the_clusters_quick_start_and_the_gpu_examples_steps_hold(tmp_path) -> None:
    quick, gpu = blocks(README.read_text(), "On a cluster")
    state = QuickStart(tmp_path)
    for cmd in quick:
        state.run(cmd)
    assert set(state.pushed) == {"pipelinerl-operator", "pipelinerl-services"}
    assert state.applied == {"tiny-arith": "examples/tiny-cpu.yaml"}
    for cmd in gpu:
        state.run(cmd)
    assert "qwen7b-gsm8k" in state.applied


def test_the_gpu_examples_prerequisites_are_what_its_manifest_asks_for() -> None:
    _, gpu = blocks(README.read_text(), "On a cluster")
    job = load_job(ROOT / "examples" / "gpu-qwen-math.yaml")
    gets = {cmd[2]: cmd for cmd in gpu if cmd[:2] == ["kubectl", "get"]}
    assert gets["priorityclass"][3] == job.spec.scheduling.priority_class_name
    assert gets["localqueue"][3] == job.spec.scheduling.queue_name
    claims, selectors = set(), set()
    for role in ("generator", "trainer"):
        pod = getattr(job.spec, role).pod_template["spec"]
        claims |= {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        selectors |= {f"{k}={v}" for k, v in pod["nodeSelector"].items()}
    assert {gets["pvc"][3]} == claims
    assert {flag(gets["nodes"], "-l")} == selectors
    paths = [job.spec.model.path, *job.spec.task.params.values()]
    # The files the job reads, as the README's comment on the claim lists them (the comment was cut above).
    line = next(x for x in README.read_text().splitlines() if x.startswith("kubectl get pvc"))
    assert all(p.split("/")[2] in line for p in paths), (paths, line)


@pytest.mark.parametrize("doc", ["README.md", "docs/kubernetes.md", "docs/runbook.md"])
def test_every_kubectl_command_names_its_namespace(doc) -> None:
    """In code blocks and inline code alike (`kubectl x y ...`), but for cluster-wide objects."""
    text = (ROOT / doc).read_text()
    fenced = [
        x for body in re.findall(r"```\w*\n(.*?)```", text, re.DOTALL) for x in body.replace("\\\n", " ").splitlines()
    ]
    inline = re.findall(r"`(kubectl [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL).replace("\n", " "))
    commands = [x[x.index("kubectl ") :] for x in fenced + inline if "kubectl " in x and len(x.split()) > 2]
    cluster_wide = re.compile(
        r"kubectl (get|describe) (priorityclass|nodes|crd)|kubectl \S.* -A\b"
        r"|kubectl (apply|delete) -f (charts/pipelinerl/)?crds/"
    )
    loose = [c for c in commands if not re.search(r"(^|\s)(-n|--namespace)(\s|=)", c) and not cluster_wide.search(c)]
    assert commands and not loose, "\n".join(loose)
