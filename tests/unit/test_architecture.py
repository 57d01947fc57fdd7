"""The import graph, read from the code (every import statement, lazy ones included): no cycle,
layers only point down, no service or the operator imports another. docs/architecture.md
explains the layers; a new module must be given one here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {  # import name -> folder
    "pipelinerl": ROOT / "pipelinerl",
    "pipelinerl_generator": ROOT / "services/generator/pipelinerl_generator",
    "pipelinerl_preprocessor": ROOT / "services/preprocessor/pipelinerl_preprocessor",
    "pipelinerl_trainer": ROOT / "services/trainer/pipelinerl_trainer",
    "pipelinerl_operator": ROOT / "operator/pipelinerl_operator",
    "bench": ROOT / "bench",
}
# Lowest first. A module may import its own layer and those below; in the services layer only
# its own package (no sideways arrows between services, nor between a service and the operator).
LAYERS = {
    "contracts": [
        "pipelinerl",
        "pipelinerl.contracts",
        "pipelinerl.k8s_types",
        "pipelinerl.engine_args",
        "pipelinerl.spec",
    ],  # "pipelinerl": its __init__ alone
    "core": [
        "pipelinerl.messages",
        "pipelinerl.streams",
        "pipelinerl.weight_group",
        "pipelinerl.admission",
        "pipelinerl.learning",
        "pipelinerl.tracking",
        "pipelinerl.capacity",
        "pipelinerl.prompt_fit",
        "pipelinerl.steps",
        "pipelinerl.planner",
        "pipelinerl.tasks",
        "pipelinerl.tiny_model",
        "pipelinerl.ports",
        "pipelinerl.runtime",
        "pipelinerl.crd",
    ],
    "services": ["pipelinerl_generator", "pipelinerl_preprocessor", "pipelinerl_trainer", "pipelinerl_operator"],
    "tools": [
        "pipelinerl.cli",
        "pipelinerl.local",
        "pipelinerl.embedded_nats",
        "pipelinerl.processes",
        "pipelinerl.pod_ranks",
        "bench",
    ],
}
ORDER = list(LAYERS)


def modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
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


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(module: str) -> tuple[int, str]:
    """(layer index, the LAYERS entry that holds it: the longest that is the module or a parent)."""
    holders = [
        (len(prefix), i, prefix)
        for i, key in enumerate(ORDER)
        for prefix in LAYERS[key]
        if module == prefix or (prefix != "pipelinerl" and module.startswith(prefix + "."))
    ]
    assert holders, f"{module} is in no layer: add it to LAYERS and docs/architecture.md"
    _, i, prefix = max(holders)
    return i, prefix


def test_every_module_has_a_layer():
    for module in modules():
        layer(module)


def test_layers_only_point_down_and_services_never_sideways():
    wrong = []
    for module, deps in graph().items():
        (mine, unit) = layer(module)
        for dep in deps:
            (theirs, their_unit) = layer(dep)
            if theirs > mine or (ORDER[mine] == "services" and theirs == mine and their_unit != unit):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


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
    assert "pipelinerl_generator.main" in g["pipelinerl.cli"]  # a lazy import inside a function
