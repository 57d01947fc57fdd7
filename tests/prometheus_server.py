"""A real Prometheus server and promtool for the monitoring tests (Debian's `prometheus` package,
which scripts/setup.sh installs). A missing binary fails the test that needs it: never a skip."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from pipelinerl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "charts" / "pipelinerl" / "files" / "alerts.yaml"
DASHBOARD = ROOT / "charts" / "pipelinerl" / "dashboards" / "pipelinerl.json"


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, (
        f"{name} not found: scripts/setup.sh installs it (Debian's `prometheus` package: apt-get install prometheus)"
    )
    return path


class Prometheus:
    """`prometheus` on a loopback port, scraping `scrape_configs` every `interval_s`, its data in `root`."""

    def __init__(self, root: Path, scrape_configs: list[dict], interval_s: float = 1.0):
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {
                        "scrape_interval": f"{round(interval_s * 1000)}ms",
                        "evaluation_interval": f"{round(interval_s * 1000)}ms",
                    },
                    "rule_files": [str(RULES)],
                    "scrape_configs": scrape_configs,
                }
            )
        )
        self.log = open(root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                binary("prometheus"),
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout_s}s:\n{self.log_tail()}")

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>: its `data` (an error answer fails the test, with Prometheus' message)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        assert body["status"] == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result vector (at `at`, Unix seconds; default now)."""
        data = self.api("query", query=expr, **({"time": at} if at is not None else {}))
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


_CLAUSES = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGES = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*+)\s*+(\{[^{}]*\})?+(?!\s*\()")
_WORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}


def vector_selectors(expr: str) -> list[str]:
    """The series selectors of a PromQL expression (`metric{matchers}`), as written: what must
    exist for it to mean anything. Functions, aggregation clauses, ranges and keywords are not."""
    text = _RANGES.sub("", _CLAUSES.sub("", expr))
    found = []
    for m in _SELECTOR.finditer(text):
        name, matchers = m.group(1), m.group(2) or ""
        if name.lower() not in _WORDS:
            found.append(name + re.sub(r"\s+", " ", matchers))
    return found


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def rule_expr(alert: str) -> str:
    (rule,) = [r for r in alert_rules() if r["alert"] == alert]
    return rule["expr"]


def job_targets(services: dict, namespace: str, job: str) -> list[dict]:
    """One static target per service of a local run (its services.json), labelled as the chart's
    PodMonitor labels the job's pods."""
    return [
        {
            "targets": [f"127.0.0.1:{s['http_port']}"],
            "labels": {
                "namespace": namespace,
                "pod": f"{job}-{s['role']}-{s['rank']}",
                "pipelinerl_dev_job": job,
                "pipelinerl_dev_role": s["role"],
            },
        }
        for s in services.values()
        if "http_port" in s
    ]


def job_scrape_config(services: dict, namespace: str, job: str) -> dict:
    return {"job_name": f"{namespace}/pipelinerl-jobs", "static_configs": job_targets(services, namespace, job)}


def file_scrape_config(path: Path, namespace: str) -> dict:
    """Targets read from `path` (file discovery, reread every second): a Prometheus started before
    the run whose ports it will scrape (write `job_targets(...)` there as JSON once they are known)."""
    return {
        "job_name": f"{namespace}/pipelinerl-jobs",
        "file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}],
    }


def held(prometheus: Prometheus, expr: str, start: float, end: float) -> list[dict]:
    """The series for which `expr` held at some second in [start, end] (each with its count)."""
    span = max(1, round(end - start))
    return prometheus.query(f"count_over_time(({expr})[{span}s:1s])", end)
