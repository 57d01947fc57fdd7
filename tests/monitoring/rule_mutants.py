"""Mutants of the alerting rules (pure): each a small change a careless edit could make to one
rule, of the kinds its promtool cases must notice: a threshold doubled or halved, an aggregation
swapped, a label dropped from a grouping or a join, a set operator swapped, a range window or
the `for:` duration doubled or halved. test_alert_rules.py requires every one to fail a case."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class Mutant:
    alert: str
    change: str  # what was changed, for the failure message
    field: str  # "expr" or "for"
    value: str


def _at(text: str, start: int, end: int, new: str) -> str:
    return text[:start] + new + text[end:]


def _scaled(n: float) -> set[float]:
    return {n + 1, n - 1} if n in (0, 1) else {n * 2, n / 2}


def expr_mutants(expr: str) -> Iterator[tuple[str, str]]:
    for m in re.finditer(rf"(>=|<=|==|!=|>|<)\s*({NUMBER})(?![\w.])", expr):
        for new in sorted(_scaled(float(m.group(2)))):
            yield f"threshold {m.group(0)} -> {new:g}", _at(expr, m.start(2), m.end(2), f"{new:g}")
    for m in re.finditer(r"\b(sum|max|min|count|avg)\b(?=\s*(?:by|without|\())", expr):
        for new in sorted({"sum", "max", "min"} - {m.group(1)}):
            yield f"aggregation {m.group(1)} -> {new} at {m.start()}", _at(expr, m.start(), m.end(), new)
    for m in re.finditer(r"\b(by|on|ignoring)\s*\(([^)]*)\)", expr):
        labels = [label.strip() for label in m.group(2).split(",") if label.strip()]
        for drop in labels:
            if drop != "le":  # histogram_quantile needs it: dropping it is an error, not a mutant
                kept = ", ".join(label for label in labels if label != drop)
                yield (
                    f"{m.group(1)} without {drop} at {m.start()}",
                    _at(expr, m.start(), m.end(), f"{m.group(1)} ({kept})"),
                )
    for m in re.finditer(r"\b(and|unless|or)\b(?=\s+on\b)", expr):
        for new in sorted({"and", "unless", "or"} - {m.group(1)}):
            yield f"join {m.group(1)} -> {new}", _at(expr, m.start(), m.end(), new)
    for m in re.finditer(r"\[(\d+)([mh])\]", expr):
        n = int(m.group(1))
        for new in sorted({n * 2, max(1, n // 2)} - {n}):
            yield (
                f"window {m.group(0)} -> [{new}{m.group(2)}] at {m.start()}",
                _at(expr, m.start(), m.end(), f"[{new}{m.group(2)}]"),
            )


def duration_mutants(duration: str) -> Iterator[tuple[str, str]]:
    m = re.fullmatch(r"(\d+)([mh])", duration)
    assert m, f"for: {duration!r}: minutes or hours expected"
    n = int(m.group(1))
    for new in sorted({n * 2, max(1, n // 2)} - {n}):
        yield f"for {duration} -> {new}{m.group(2)}", f"{new}{m.group(2)}"


def mutants(rule: dict) -> list[Mutant]:
    out = [Mutant(rule["alert"], change, "expr", value) for change, value in expr_mutants(rule["expr"])]
    if "for" in rule:
        out += [Mutant(rule["alert"], change, "for", value) for change, value in duration_mutants(rule["for"])]
    return out
