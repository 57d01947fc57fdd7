"""How benchmark results are kept in bench/results: small where people read them, whole where
the analyses need them.

A result whose runs carry per-step records (`steps_log`: the learning-speed benchmarks, up to
6 MB each; `eval_correct`, each evaluation's per-problem results) is kept as two files:
NAME.json, its summary (every figure, setting, seed and warm start, each run's evaluations;
only those records left out, and `"full_record"` naming the other file), and NAME.json.xz, the
whole result, xz-compressed (about a seventh of its size). Every other result is one plain
NAME.json. A superseded result (kept as history, quoted by no current figure) keeps its summary
only (`retire`): bench/results stays under LIMIT_BYTES.

`read_result` reads either form, given NAME.json or NAME.json.xz, and always returns the whole
result: `--reanalyse`, `--sweep-with`, `calibrate_cpu --from/--split-with` take the paths they
always took. `python -m bench.results_store [FILE ...]` puts existing results in this form (all
of bench/results by default; the compressed file holds the original bytes); `--retire FILE ...`
keeps only the summaries of superseded ones.
"""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# The per-step records (97% of the bytes of the learning-speed results) and each evaluation's
# per-problem results (what `analysis.evaluation_spread` resamples).
BULKY = ("steps_log", "eval_correct")
FULL = "full_record"  # the summary's pointer to the whole result
RETIRED = "per_step_records"  # in a retired result's summary, in place of FULL
XZ = ".xz"
LIMIT_BYTES = 8_000_000  # bench/results as a whole


def has_bulk(data: Any) -> bool:
    if isinstance(data, dict):
        return any(k in data for k in BULKY) or any(has_bulk(v) for v in data.values())
    if isinstance(data, list):
        return any(has_bulk(v) for v in data)
    return False


def summary_of(data: Any) -> Any:
    """`data` without its bulky records (`BULKY`), anywhere in it."""
    if isinstance(data, dict):
        return {k: summary_of(v) for k, v in data.items() if k not in BULKY}
    if isinstance(data, list):
        return [summary_of(v) for v in data]
    return data


def full_path(path: Path) -> Path:
    """NAME.json.xz beside NAME.json."""
    return path.with_name(path.name + XZ)


def read_result(path: str | Path) -> dict:
    """The whole result saved at `path` (NAME.json, summary or not, or NAME.json.xz)."""
    path = Path(path)
    if path.name.endswith(XZ):
        return json.loads(lzma.decompress(path.read_bytes()))
    if not path.exists() and full_path(path).exists():
        return read_result(full_path(path))
    data = json.loads(path.read_text())
    if FULL in data:
        return read_result(path.with_name(data[FULL]))
    return data


def write_result(path: Path, data: dict, text: str | None = None) -> None:
    """Save `data` at `path` (NAME.json) in the form above; `text`: its JSON as it should be kept
    (default: indented), compressed where a summary stands in for it."""
    text = text if text is not None else json.dumps(data, indent=1) + "\n"
    if not has_bulk(data):
        path.write_text(text)
        full_path(path).unlink(missing_ok=True)
        return
    full_path(path).write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    summary = summary_of(data) | {FULL: full_path(path).name}
    path.write_text(json.dumps(summary, indent=1) + "\n")


def compact(path: Path) -> bool:
    """Put an existing result in the kept form (its original bytes compressed); False where it
    is in that form already or has no per-step records."""
    text = path.read_text()
    data = json.loads(text)
    if FULL in data or not has_bulk(data):
        return False
    write_result(path, data, text)
    if read_result(path) != data:  # never drop a byte the analyses need
        raise SystemExit(f"{path}: the compressed result does not read back the same")
    return True


def retire(path: Path) -> None:
    """Keep only the summary of a superseded result: its per-step records (the compressed whole)
    go, and the summary says so instead of pointing to them."""
    data = json.loads(path.read_text())
    if FULL not in data:
        raise SystemExit(f"{path}: no compressed whole result to retire")
    full_path(path).unlink()
    data = {k: v for k, v in data.items() if k != FULL} | {
        RETIRED: "dropped: a superseded result, its figures kept here"
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


def kept_results() -> list[Path]:
    """The results in bench/results; not a running benchmark's runs so far (`NAME.partial.json`,
    which git ignores)."""
    return sorted(p for p in RESULTS.glob("*.json") if not p.name.endswith(".partial.json"))


def main(argv: list[str]) -> None:
    if argv[:1] == ["--retire"]:
        for path in argv[1:]:
            retire(Path(path))
        return
    paths = [Path(p) for p in argv] or kept_results()
    for path in paths:
        before = path.stat().st_size
        if compact(path):
            print(f"{path}: {before:,} bytes -> {path.stat().st_size:,} + {full_path(path).stat().st_size:,} (xz)")


if __name__ == "__main__":
    main(sys.argv[1:])
