"""Retired benchmarks (bench/README.md, last section): every figure quoted for one is what its
kept result in bench/results/ gives, and its code is gone from the tree."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}"


def over_plain(d: dict, side: str) -> float:
    return d["sides"][side]["vs_plain_packed"]["median"]


# benchmark: (its line's start in bench/README.md, results file, the figures the line quotes)
RETIRED: dict[str, tuple[str, str, Callable[[dict], list[str]]]] = {
    "transport": (
        "- **3, transport**",
        "transport.json",
        lambda d: [
            f"**{d['preprocessor']['median']:,.0f} groups/s**",
            f"raw JetStream's {d['raw']['median']:,.0f}",
            f"({d['ratio']['median']:.2f}× paired)",
            f"**{d['margin']['median']:.0f}×**",
            f"demand of {d['demand_groups_per_s']:.1f}",
        ],
    ),
    "trainer_overhead": (
        "- **4, trainer overhead on CPU**",
        "trainer_overhead.json",
        lambda d: [
            f"**{d['deepspeed_overhead']:.2f}×**",  # (the sides' times over plain PyTorch's, packed)
            "({min:.2f}–{max:.2f}; ".format(**d["sides"]["deepspeed ZeRO-1, packed 512"]["vs_plain_packed"]),
            f"row mask {over_plain(d, 'plain PyTorch, packed 512, stock SDPA row mask'):.2f}×",
            f"padded batch {over_plain(d, 'plain PyTorch, padded batch'):.2f}×",
        ],
    ),
    "engine": (
        "- **5, engine**",
        "engine.json",
        lambda d: [
            f"{d['models']['tiny-arith']['vllm_over_hf']['median']:.2f}× at 3M",
            f"{d['models']['30M']['vllm_over_hf']['median']:.2f}× at 30M",
            f"({d['models']['tiny-arith']['vllm']['median']:,.0f} tokens/s)",
        ],
    ),
    "elastic": (
        "- **7, elastic weight plane**",
        "elastic.json",
        lambda d: [
            f"{d['summary']['2_generators']['death_to_next_step_s']['median']:.2f} s later with two",
            f"({d['summary']['1_generators']['death_to_next_step_s']['median']:.2f} s with one)",
            f"{d['summary']['2_generators']['restart_to_ready_s']['median']:.1f} s after its start",
            f"({d['summary']['1_generators']['restart_to_ready_s']['median']:.1f} s with one)",
            f"{d['summary']['2_generators']['join_to_ready_s']['median']:.2f} s of it from joining",
            f"{d['summary']['epoch_change_sync_s']['median'] * 1000:.0f} ms against",
            f"{d['summary']['plain_sync_s']['median'] * 1000:.0f} ms for a plain one",
        ],
    ),
    "joiner_source": (
        "- **8, a joiner's first weights**",
        "joiner_source.json",
        lambda d: [
            " / ".join(ms(d["sizes"][size]["seconds"]["broadcast"]) for size in ("3M", "30M", "120M")),
            " / ".join(ms(d["sizes"][size]["seconds"]["disk_cold"]) for size in ("3M", "30M", "120M")),
        ],
    ),
}


def readme_entry(start: str) -> str:
    text = (ROOT / "bench" / "README.md").read_text()
    section = text[text.index("## Retired benchmarks") :]
    at = section.index(start)
    end = section.find("\n- **", at + 1)
    return " ".join(section[at : end if end > 0 else None].split())  # as read, not as wrapped


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_benchmarks_figures_are_its_kept_results(name):
    start, results, figures = RETIRED[name]
    entry = readme_entry(start)
    assert f"(`{results}`" in entry
    data = json.loads((RESULTS / results).read_text())
    assert data["benchmark"] == name
    missing = [f for f in figures(data) if f not in entry]
    assert not missing, f"bench/README.md's line for {name} does not quote its kept result: {missing}\n{entry}"
    assert not (ROOT / "bench" / f"{name}.py").exists(), f"bench/{name}.py is back: give it its section again"
