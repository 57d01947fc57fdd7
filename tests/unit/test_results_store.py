"""Benchmark results kept lean (bench/results_store.py): a result with per-step records is kept as
a readable summary plus the whole result xz-compressed, and every loader (`--reanalyse`,
`--sweep-with`, `calibrate_cpu --from`) reads the whole result through the summary's path, so no
analysis loses anything; the repository's own results are checked to be in that form and whole,
and bench/results to stay under its size limit (superseded results keep their summaries only)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

from bench.common import pooled_runs, save
from bench.results_store import (
    FULL,
    LIMIT_BYTES,
    RESULTS,
    RETIRED,
    compact,
    full_path,
    has_bulk,
    kept_results,
    read_result,
    retire,
    summary_of,
    write_result,
)


def result(steps: int = 50) -> dict:
    run = {
        "seed": 42,
        "warm_start_accuracy": 0.296,
        "evals": [{"version": 0, "time": 1.0, "accuracy": 0.296}],
        "steps_log": [{"step": i, "time": 0.5 * i, "tokens": 500 + i} for i in range(steps)],
    }
    return {"benchmark": "b", "headline": {"median": 1.84}, "runs": {"pipeline": [run], "sync": [run]}}


def test_a_result_with_per_step_records_is_kept_as_a_summary_and_the_whole_compressed(tmp_path):
    path, data = tmp_path / "b.json", result()
    write_result(path, data)
    summary = json.loads(path.read_text())
    assert not has_bulk(summary) and summary[FULL] == "b.json.xz"
    assert summary["runs"]["sync"][0]["seed"] == 42 and summary["headline"] == {"median": 1.84}  # what READMEs quote
    assert summary["runs"]["sync"][0]["evals"] == data["runs"]["sync"][0]["evals"]
    assert read_result(path) == data == read_result(full_path(path))  # either path: the whole result
    assert path.stat().st_size < len(json.dumps(data)) / 3


def test_a_result_without_them_stays_one_plain_file(tmp_path):
    path = tmp_path / "b.json"
    write_result(path, result())
    write_result(path, {"benchmark": "b", "figure": 1.07})  # saved again, now small: the old .xz goes
    assert json.loads(path.read_text()) == {"benchmark": "b", "figure": 1.07} and not full_path(path).exists()


def test_compacting_keeps_the_original_bytes_and_is_done_once(tmp_path):
    path = tmp_path / "r.json"
    text = json.dumps(result(), indent=1) + "\n"
    path.write_text(text)
    assert compact(path) is True
    assert lzma.decompress(full_path(path).read_bytes()).decode() == text
    assert compact(path) is False  # a summary already
    full_path(path).rename(tmp_path / "elsewhere")
    path.unlink()
    (tmp_path / "elsewhere").rename(full_path(path))
    assert read_result(path) == json.loads(text)  # NAME.json asked for, only NAME.json.xz there


def test_save_keeps_a_new_result_in_the_same_form(tmp_path):
    path = save("new", result(), "python -m bench.x", tmp_path)
    assert full_path(path).exists() and read_result(path)["runs"] == result()["runs"]
    assert json.loads(path.read_text())["command"] == "python -m bench.x"


def test_the_loaders_read_the_whole_runs_through_a_summarys_path():
    path = RESULTS / "pipeline_vs_sync.json"
    assert FULL in json.loads(path.read_text())  # the repository keeps its summary
    runs, _ = pooled_runs([path], ["pipeline", "sync"])  # --reanalyse
    assert len(runs["pipeline"]) == len(runs["sync"]) == 10
    assert all(run["steps_log"] for xs in runs.values() for run in xs)
    from bench.calibrate_cpu import load  # calibrate_cpu --from

    assert all(run["steps_log"] for run in load(path)["runs"]["pipeline"])


def test_every_kept_result_is_whole_and_its_summary_matches_it():
    summaries = [p for p in kept_results() if FULL in json.loads(p.read_text())]
    assert len(summaries) >= 20
    for path in summaries:
        whole = read_result(path)
        assert has_bulk(whole), path
        assert summary_of(whole) | {FULL: full_path(path).name} == json.loads(path.read_text()), path
    for path in kept_results():  # no result carries its per-step records uncompressed
        assert not has_bulk(json.loads(path.read_text())), path
    orphans = [p for p in RESULTS.glob("*.json.xz") if not Path(str(p).removesuffix(".xz")).exists()]
    assert orphans == []


def test_a_retired_result_keeps_its_summary_and_says_its_records_are_gone(tmp_path):
    path = tmp_path / "old.json"
    write_result(path, result())
    retire(path)
    kept = json.loads(path.read_text())
    assert not full_path(path).exists() and FULL not in kept and RETIRED in kept
    assert kept["headline"] == {"median": 1.84} and read_result(path) == kept


def test_bench_results_stay_under_their_limit():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert total < LIMIT_BYTES, f"bench/results: {total:,} bytes; retire superseded results ({biggest})"
