"""The chart's alerting rules under promtool: valid, and each alert raised by the series that should
raise it and not by the ones that should not (alerts_test.yaml), in cases that fail when an alert
breaks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from prometheus_server import RULES, alert_rules, binary, vector_selectors

CASES = Path(__file__).with_name("alerts_test.yaml")


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
