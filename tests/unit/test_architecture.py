"""The import graph, read from the code (every import statement, lazy ones included): no cycle,
layers only point down, no service or the operator imports another. A module's layer is the
folder it lives in (FOLDERS; docs/architecture.md explains them); a planted import in each
direction shows the check can fail."""

from __future__ import annotations

import ast
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A module's layer is the folder it lives in, lowest first. A module may import its own layer and
# those below; in the services layer only its own package (no sideways arrows between services,
# nor between a service and the operator).
FOLDERS = {
    "pipelinerl": "core",
    "services/generator": "services",
    "services/preprocessor": "services",
    "services/trainer": "services",
    "operator": "services",
    "cli": "face",
    "bench": "tools",
}
ORDER = ["contracts", "core", "services", "face", "tools"]
# The names every component shares: the lowest part of the core folder, importing only each other.
CONTRACTS = {
    "pipelinerl",  # its __init__ alone
    "pipelinerl.contracts",
    "pipelinerl.k8s_types",
    "pipelinerl.engine_args",
    "pipelinerl.spec",
    "pipelinerl.spec_base",
    "pipelinerl.spec_roles",
    "pipelinerl.spec_sections",
}


# Across the layers, three kinds of module: pure rules (no I/O of their own: the logic the
# services are made of, tested thoroughly on their own), wire formats, and the I/O shells around
# them. A rule or a wire format imports only rules, wire formats and contracts of the project, and
# no I/O library: a rule that reached for NATS or a socket would be tested through its I/O again.
PURE = {
    "pipelinerl.admission",
    "pipelinerl.books",
    "pipelinerl.capacity",
    "pipelinerl.claims",
    "pipelinerl.crd",
    "pipelinerl.generator_memory",
    "pipelinerl.group_checks",
    "pipelinerl.learning",
    "pipelinerl.phases",
    "pipelinerl.reserved",
    "pipelinerl.steps",
    "pipelinerl.planner.bound",
    "pipelinerl.planner.calibration",
    "pipelinerl.planner.recommend",
    "pipelinerl.planner.sim_params",
    "pipelinerl.planner.simulation",
    "pipelinerl_preprocessor.advantages",
    "pipelinerl_preprocessor.builder",
    "pipelinerl_preprocessor.packing",
    "pipelinerl_trainer.checks",
    "pipelinerl_trainer.membership",
    "pipelinerl_trainer.position",
    "pipelinerl_operator.config",
    "pipelinerl_operator.credentials",
    "pipelinerl_operator.egress",
    "pipelinerl_operator.job_policy",
    "pipelinerl_operator.names",
    "pipelinerl_operator.pod_security",
    "pipelinerl_operator.pod_template",
    "pipelinerl_operator.pods",
    "pipelinerl_operator.policy_checks",
    "pipelinerl_operator.policy_job",
    "pipelinerl_operator.render",
    "pipelinerl_operator.status",
}
WIRE = {"pipelinerl.messages"}
IO_LIBRARIES = ("nats", "httpx", "aiohttp", "fastapi", "uvicorn", "kopf", "kubernetes", "socket", "subprocess",
                "torch.distributed", "urllib.request", "requests", "vllm", "deepspeed")  # fmt: skip


def packages(root: Path) -> dict[str, tuple[Path, str]]:
    """import name -> (folder, layer): a layered folder is a package or holds packages."""
    out = {}
    for folder, layer in FOLDERS.items():
        path = root / folder
        candidates = [path] if (path / "__init__.py").exists() else sorted(path.glob("*/__init__.py"))
        for init in candidates:
            package = init if init.is_dir() else init.parent
            out[package.name] = (package, layer)
    return out


def modules(root: Path = ROOT) -> dict[str, tuple[Path, str, str]]:
    """module -> (path, layer, unit): the unit is its top-level package (services may not cross)."""
    out = {}
    for package, (folder, layer) in packages(root).items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            out[name] = (path, "contracts" if name in CONTRACTS else layer, package)
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports (the longest known prefix of each imported name)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, (path, _, _) in mods.items()}


def violations(root: Path = ROOT) -> list[str]:
    """Every import against the layering, as "module -> imported"."""
    mods, wrong = modules(root), []
    for module, deps in graph(root).items():
        _, layer, unit = mods[module]
        for dep in deps:
            _, their_layer, their_unit = mods[dep]
            up = ORDER.index(their_layer) > ORDER.index(layer)
            sideways = layer == their_layer == "services" and their_unit != unit
            if up or sideways:
                wrong.append(f"{module} -> {dep}")
    return sorted(wrong)


def library_imports(path: Path) -> set[str]:
    """Every module name a file imports, lazy imports included (the project's and libraries')."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def kind_violations(root: Path = ROOT) -> list[str]:
    """A rule or a wire format importing an I/O module of the project, or an I/O library."""
    mods, wrong = modules(root), []
    contracts = {name for name, (_, layer, _) in mods.items() if layer == "contracts"}
    allowed = PURE | WIRE | contracts | set(packages(root))  # (a package's own __init__: empty)
    for module, deps in graph(root).items():
        if module not in PURE | WIRE:
            continue
        wrong += [f"{module} -> {dep}" for dep in sorted(deps - allowed)]
        for name in sorted(library_imports(mods[module][0])):
            if any(name == lib or name.startswith(lib + ".") for lib in IO_LIBRARIES):
                wrong.append(f"{module} -> {name} (an I/O library)")
    return wrong


def test_rules_and_wire_formats_do_no_io():
    assert not kind_violations(), "a rule or a wire format reaching for I/O:\n" + "\n".join(kind_violations())
    assert PURE | WIRE <= set(modules()), "a module named here no longer exists: " + str(PURE | WIRE - set(modules()))


def test_a_planted_import_of_io_into_a_rule_or_a_wire_format_is_caught(tmp_path: Path):
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    planted = {  # file -> import it gains: each arrow the kinds forbid
        "pipelinerl/books.py": "import pipelinerl.streams",  # a rule -> the core's I/O
        "pipelinerl/messages.py": "from pipelinerl.weight_group import WeightGroup",  # a wire format -> I/O
        "pipelinerl/steps.py": "import nats",  # a rule -> an I/O library
        "services/preprocessor/pipelinerl_preprocessor/builder.py": "from pipelinerl_preprocessor.main import main",
        "operator/pipelinerl_operator/render.py": "import kubernetes.client",  # lazily, in a function too
    }
    for file, line in planted.items():
        path = tmp_path / file
        path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")
    assert set(kind_violations(tmp_path)) == {
        "pipelinerl.books -> pipelinerl.streams",
        "pipelinerl.messages -> pipelinerl.weight_group",
        "pipelinerl.steps -> nats (an I/O library)",
        "pipelinerl_preprocessor.builder -> pipelinerl_preprocessor.main",
        "pipelinerl_operator.render -> kubernetes.client (an I/O library)",
    }


def test_every_installed_package_lives_in_a_layered_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    layered = packages(ROOT)
    for package, folder in config["package-dir"].items():
        assert package in layered and layered[package][0] == ROOT / folder, (
            f"{package} ({folder}) is in no layered folder: add its folder to FOLDERS and docs/architecture.md"
        )


def test_layers_only_point_down_and_services_never_sideways():
    assert not violations(), "imports against the layering:\n" + "\n".join(violations())


PLANTED = {  # file -> import it gains: upwards from each layer, sideways between services
    "pipelinerl/spec.py": "import pipelinerl.streams",
    "pipelinerl/steps.py": "import pipelinerl_trainer.loss",
    "pipelinerl/admission.py": "import pipelinerl_cli.local",
    "services/generator/pipelinerl_generator/engine.py": "from pipelinerl_trainer.loss import rl_loss",
    "operator/pipelinerl_operator/render.py": "from pipelinerl_cli.main import main",
    "services/trainer/pipelinerl_trainer/loss.py": "import bench.common",
    "cli/pipelinerl_cli/local.py": "import bench.common",
}


def test_a_planted_import_against_the_layers_is_caught(tmp_path: Path):
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    for file, line in PLANTED.items():
        path = tmp_path / file
        path.write_text(path.read_text() + f"\n{line}\n")
    # Downward arrows stay allowed: the face may import a service, a service the core.
    (tmp_path / "cli/pipelinerl_cli/planted.py").write_text("import pipelinerl_trainer.loss\nimport pipelinerl.steps\n")
    found = violations(tmp_path)
    planted = {
        "pipelinerl.spec -> pipelinerl.streams",
        "pipelinerl.steps -> pipelinerl_trainer.loss",
        "pipelinerl.admission -> pipelinerl_cli.local",
        "pipelinerl_generator.engine -> pipelinerl_trainer.loss",
        "pipelinerl_operator.render -> pipelinerl_cli.main",
        "pipelinerl_trainer.loss -> bench.common",
        "pipelinerl_cli.local -> bench.common",
    }
    assert set(found) == planted, found


def test_contracts_import_nothing_of_the_project():
    assert graph()["pipelinerl.contracts"] == set()


def test_no_import_cycle():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    # A package's __init__ importing its own submodules (re-exports) is not a cycle of layers, but
    # it is still a cycle: none is allowed.
    assert not cycles, f"import cycles: {cycles}"


def test_the_checker_sees_real_edges():
    # Guard against a checker that finds nothing: known edges in both import styles.
    g = graph()
    assert "pipelinerl.contracts" in g["pipelinerl.spec"]
    assert "pipelinerl_generator.engine" in g["pipelinerl_generator.main"]
    assert "pipelinerl_generator.main" in g["pipelinerl_cli.main"]  # a lazy import inside a function


def test_no_module_imports_the_tests():
    """The tests import the code, never the other way round (a harness a benchmark shares with
    the tests lives in bench/, as bench/run_process.py does)."""
    found = []
    for name, (path, _, _) in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            found += [f"{name} -> {t}" for t in targets if t == "tests" or t.startswith("tests.")]
    assert not found, found
