"""The chart's alerting rules under promtool: valid, and each alert raised by the series that should
raise it and not by the ones that should not (alerts_test.yaml), in cases that fail when an alert
breaks: every mutant of its thresholds, aggregations, joins, windows and durations fails one
(rule_mutants.py). Each alert links its own section of docs/runbook.md."""

from __future__ import annotations

import re
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from prometheus_server import ROOT, RULES, alert_rules, binary, vector_selectors
from rule_mutants import Mutant, mutants

CASES = Path(__file__).with_name("alerts_test.yaml")
BOUNDS = Path(__file__).with_name("alert_bounds_test.yaml")
RUNBOOK = ROOT / "docs" / "runbook.md"
RUNBOOK_URL = "https://github.com/pipelinerl/pipelinerl-k8s/blob/main/docs/runbook.md"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_rules_file_is_valid_prometheus_rules():
    done = promtool("check", "rules", str(RULES), cwd=RULES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not():
    cases = [c for t in yaml.safe_load(CASES.read_text())["tests"] for c in t["alert_rule_test"]]
    for rule in alert_rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no case where it stays quiet"


def test_the_promtool_cases_pass():
    done = promtool("test", "rules", CASES.name, cwd=CASES.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_the_cases_fail_when_an_alert_never_fires(tmp_path):
    # The same rules, each alert's expression made one that never holds: every firing case fails.
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["expr"] = "vector(1) < 0"
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "alerts.yaml").write_text(yaml.safe_dump(rules))
    cases = yaml.safe_load(CASES.read_text())
    cases["rule_files"] = ["rules/alerts.yaml"]
    (tmp_path / "cases.yaml").write_text(yaml.safe_dump(cases))
    done = promtool("test", "rules", "cases.yaml", cwd=tmp_path)
    assert done.returncode != 0
    for rule in alert_rules():
        assert f"alertname: {rule['alert']}," in done.stdout + done.stderr, rule["alert"]


def test_vector_selectors_finds_the_series_of_an_expression():
    expr = """
      histogram_quantile(0.95, sum by (le, namespace) (rate(pipelinerl_weight_sync_seconds_bucket{job=~"$job"}[5m])))
      > on (namespace) group_left max without (pod) (up{pipelinerl_dev_role="generator"} offset 5m) and bool time() > 0
    """
    assert vector_selectors(expr) == [
        'pipelinerl_weight_sync_seconds_bucket{job=~"$job"}',
        'up{pipelinerl_dev_role="generator"}',
    ]
    assert vector_selectors("sum(rate(pipelinerl_operator_reconcile_errors_total[5m]))") == [
        "pipelinerl_operator_reconcile_errors_total"
    ]


def test_every_alert_links_its_own_section_of_the_runbook():
    sections = re.findall(r"^## (\w+)$", RUNBOOK.read_text(), re.MULTILINE)
    assert sorted(sections) == sorted(r["alert"] for r in alert_rules())  # one each, none stale
    for rule in alert_rules():  # GitHub's anchor for a heading of one word: the word in lowercase
        assert rule["annotations"]["runbook_url"] == f"{RUNBOOK_URL}#{rule['alert'].lower()}", rule["alert"]


def without_messages(rules: dict, case_files: list[Path]) -> list[dict]:
    """Each case file's tests with the expected annotations left out, and the rules' annotations
    too: alert_bounds_test.yaml's cases compare labels only."""
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    tests = []
    for path in case_files:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test["alert_rule_test"]:
                for alert in case.get("exp_alerts") or []:
                    alert.pop("exp_annotations", None)
            tests.append(test)
    return tests


def passes(rules: dict, tests: list[dict]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "rules.yaml").write_text(yaml.safe_dump(rules))
        cases = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
        (Path(d) / "cases.yaml").write_text(yaml.safe_dump(cases))
        return promtool("test", "rules", "cases.yaml", cwd=Path(d))


def test_the_cases_at_the_edges_pass():
    rules = yaml.safe_load(RULES.read_text())
    done = passes(rules, without_messages(rules, [BOUNDS]))
    assert done.returncode == 0, done.stdout + done.stderr


def killed(batch: list[Mutant]) -> set[tuple[str, str]]:
    """The mutants of `batch` (at most one per alert, all in place at once) that fail a case:
    promtool names each failing case's alert, and a rule's cases read no other rule."""
    rules = yaml.safe_load(RULES.read_text())
    mine = {m.alert: m for m in batch}
    assert len(mine) == len(batch), "one mutant per alert in a batch"
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule["alert"] in mine:
                rule[mine[rule["alert"]].field] = mine[rule["alert"]].value
    tests = []
    for test in without_messages(rules, [CASES, BOUNDS]):  # only the cases of the batch's alerts
        cases = [c for c in test["alert_rule_test"] if c["alertname"] in mine]
        if cases:
            tests.append(test | {"alert_rule_test": cases})
    done = passes(rules, tests)
    failing = set(re.findall(r"alertname: (\w+),", done.stdout + done.stderr))
    return {(m.alert, m.change) for m in batch if m.alert in failing}


# Mutants no series can tell from the rule: sum and max agree on whether non-negative values
# are above 0 (or all 0), and a sum of 1s is their count.
EQUIVALENT = {
    ("PipelineRLLearningAlarm", "aggregation max -> sum at 0"),
    ("PipelineRLGeneratorOutOfWeightGroup", "aggregation count -> sum at 0"),
    ("PipelineRLJobNotReady", "aggregation max -> sum at 0"),
    ("PipelineRLOperatorReconcileErrors", "aggregation sum -> max at 0"),
    ("PipelineRLStoreNotAcknowledging", "aggregation sum -> max at 0"),
}


def test_every_mutant_of_the_rules_fails_a_case():
    tried = {r["alert"]: [m for m in mutants(r) if (m.alert, m.change) not in EQUIVALENT] for r in alert_rules()}
    assert sum(map(len, tried.values())) > 100
    assert EQUIVALENT <= {(m.alert, m.change) for r in alert_rules() for m in mutants(r)}
    # The i-th mutant of every alert in one promtool run: as many runs as one alert has mutants.
    batches = [[ms[i] for ms in tried.values() if i < len(ms)] for i in range(max(map(len, tried.values())))]
    with ThreadPoolExecutor(4) as pool:
        dead = set().union(*pool.map(killed, batches))
    alive = [m for ms in tried.values() for m in ms if (m.alert, m.change) not in dead]
    assert not alive, "mutants no case kills:\n" + "\n".join(f"{m.alert}: {m.change}" for m in alive)
