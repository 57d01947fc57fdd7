"""Shared bench harness: alternate the sides of a comparison, repeat, report median and spread.

This machine is shared and noisy, so a figure is only ever a ratio of two sides measured in
the same run, interleaved A B A B … so that background load hits both alike.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import yaml

RESULTS = Path(__file__).parent / "results"


def alternate(sides: dict[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run each side's measurement `warmup` times (discarded), then `repeats` rounds, interleaved.

    Each callable returns one measured value (seconds, or a rate); the lists keep round order.
    """
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            out[name].append(fn())
    return out


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratios(a: list[float], b: list[float]) -> dict[str, float]:
    """a[i]/b[i] per round (rounds ran back to back, so they share the background load)."""
    return summary([x / y for x, y in zip(a, b)])


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def machine() -> dict[str, object]:
    import os

    import torch

    info: dict[str, object] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "cpu",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    return info


def save(name: str, result: dict, command: str) -> Path:
    """bench/results/<name>.json with the machine, the command that reproduces it and the time."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "benchmark": name,
        "command": command,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def pooled_runs(paths: list[str | Path], sides: list[str]) -> dict[str, list[dict]]:
    """The saved runs (`{"runs": {side: [run, ...]}}`) of several results files, pooled per side,
    in file order; sides with no runs are left out."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for path in paths:
        saved = json.loads(Path(path).read_text())["runs"]
        for side in runs:
            runs[side] += saved.get(side, [])
    return {side: xs for side, xs in runs.items() if xs}


def set_fields(spec: dict, items: list[str]) -> None:
    """Change a job's spec in place by "FIELD=VALUE" items (dotted camelCase paths, YAML values)."""
    for item in items:
        field, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{item!r}: expected FIELD=VALUE, e.g. rl.maxLag=2")
        *parents, leaf = field.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(value)
