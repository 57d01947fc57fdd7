"""One tiny job through `pipelinerl run`, watched, then fed poison (one run serves both tests:
each run's start costs about a minute of the suite).

Watched: a real Prometheus scrapes every service's /metrics on loopback with the labels the
chart's PodMonitor gives job pods (namespace, pod, pipelinerl_dev_job, pipelinerl_dev_role), the
rules file loaded. Every data-plane dashboard query (template variables substituted) must return
series for the run, every alert rule must evaluate without error, every series an alert reads
must exist, and nothing fires for the healthy run. Not from a run: the job-state panels read
kube-state-metrics' view of the PipelineRLJob (`pipelinerl_job_*`) and the operator's own series
(`pipelinerl_operator_*`); no kube-state-metrics nor API server runs here, so
test_k8s_monitoring.py checks them against the chart's KSM config and the operator's registry.

Then poisoned: no single message stops a job. Bad rollout groups published into the running
job's stream (with the project's own codec, as a buggy task or environment would) are
dead-lettered with their reason, and the run goes on and finishes every step."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from jobs import stored, tiny_job  # tests/e2e/jobs.py

from prometheus_server import DASHBOARD, Prometheus, alert_rules, vector_selectors  # tests/prometheus_server.py
from bench.run_process import RunProcess
from pipelinerl import messages as m
from pipelinerl.contracts import DEADLETTER_REASON, JobSubjects
from pipelinerl.streams import connect, last_message

pytestmark = pytest.mark.slow
JOB, NAMESPACE = "watched", "local"
# Room after the watching (the run steps on meanwhile) for several copies of the vocab group.
STEPS = 32
FORGER = 7  # no such generator: the forged groups' credit cannot disturb a real one's admission
# Series that come from kube-state-metrics or the operator, not from a job's pods.
ELSEWHERE = re.compile(r"^(pipelinerl_job_|pipelinerl_operator_)")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The run both tests share, in file order: watched while healthy, then poisoned to its end."""
    tmp_path = tmp_path_factory.mktemp("watched")
    job = tiny_job(JOB, trainer={"maxSteps": STEPS}, eval={"interval": 2, "problems": 16}, rl={"maxLag": 3})
    run = RunProcess(tmp_path, job, timeout_s=400)
    try:
        yield run
    finally:
        run.abandon()  # a test failed midway (a finished run: nothing left to stop)


def scrape_config(services: dict) -> dict:
    """One static target per service, labelled as the PodMonitor labels the job's pods."""
    return {
        "job_name": f"{NAMESPACE}/pipelinerl-jobs",
        "static_configs": [
            {
                "targets": [f"127.0.0.1:{s['http_port']}"],
                "labels": {
                    "namespace": NAMESPACE,
                    "pod": f"{JOB}-{s['role']}-{s['rank']}",
                    "pipelinerl_dev_job": JOB,
                    "pipelinerl_dev_role": s["role"],
                },
            }
            for name, s in services.items()
            if "http_port" in s
        ],
    }


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def substituted(expr: str) -> str:
    """As Grafana sends it with this run chosen in the job and namespace variables."""
    return expr.replace("$namespace", NAMESPACE).replace("$job", JOB).replace("$__rate_interval", "1m")


def test_every_dashboard_query_and_alert_series_has_data_for_a_real_run(live, tmp_path):
    run = live
    assert run.proc.poll() is None, "the shared run ended before it was watched: run this file in order"
    prometheus = None
    try:
        run.wait_until(lambda _: (run.dir / "services.json").exists(), "services.json")
        services = run.services()
        assert {s["role"] for s in services.values() if "http_port" in s} == {"generator", "preprocessor", "trainer"}
        prometheus = Prometheus(tmp_path / "prometheus", [scrape_config(services)], interval_s=1.0)
        prometheus.wait_ready()
        # A few steps, an evaluation after the first weights, then a few scrapes of all that.
        run.wait_step(4)
        time.sleep(4)
        at = time.time()
        targets = prometheus.api("targets")["activeTargets"]
        assert len(targets) == 3 and all(t["health"] == "up" for t in targets), targets

        missing = []
        checked = []
        for title, expr in dashboard_queries():
            if any(ELSEWHERE.match(s) for s in vector_selectors(expr)):
                continue
            checked.append(title)
            if not prometheus.query(substituted(expr), at):
                missing.append(f"panel {title!r}: {substituted(expr)}")
        for rule in alert_rules():
            prometheus.query(rule["expr"], at)  # evaluates (an error fails here)
            for selector in vector_selectors(rule["expr"]):
                if not ELSEWHERE.match(selector) and not prometheus.query(f"count({selector})", at):
                    missing.append(f"alert {rule['alert']}: {selector}")
        assert not missing, "no data for:\n" + "\n".join(missing)
        # Every data-plane panel was checked here (the panels not checked read KSM or the operator).
        assert {"Held-out accuracy", "ESS", "KL and entropy", "Lag of trained tokens", "Generator tokens/s"} <= set(
            checked
        )

        # The values are the run's, not zeros: it stepped, generated, evaluated and synced weights.
        def scalar(expr: str) -> float:
            (sample,) = prometheus.query(expr, at)
            return float(sample["value"][1])

        assert scalar(f'max(pipelinerl_trainer_step{{pipelinerl_dev_job="{JOB}"}})') >= 4
        assert scalar("sum(rate(pipelinerl_generator_tokens_total[1m]))") > 0
        assert 0 < scalar("max(rate(pipelinerl_generator_busy_seconds_total[1m]))") <= 1.05
        assert 0 < scalar("max(pipelinerl_trainer_ess)") <= 1
        assert scalar("max(pipelinerl_generator_eval_version)") >= 0
        assert scalar("max(pipelinerl_trainer_generators_in_group)") == 1
        assert scalar('max(pipelinerl_stream_limit_bytes{stream="ROLLOUTS"})') > 0
        assert scalar("sum(pipelinerl_weight_sync_seconds_count)") >= 4
        # Prometheus evaluated every rule on this data without error, and nothing fires for a healthy run.
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"] if r["type"] == "alerting"]
        assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules())
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert not prometheus.query('ALERTS{alertstate="firing"}', at)
    finally:
        if prometheus is not None:
            prometheus.stop()


def group(gid: str, **change) -> m.RolloutGroup:
    sample = m.Sample(
        tokens=[5, 6, 7, 8], mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.7], versions=[-1, -1, 0, 0], reward=1.0
    )
    return m.RolloutGroup(
        group_id=gid,
        generator=FORGER,
        samples=[sample.model_copy(update=change), sample.model_copy(update={"reward": 0.0})],
    )


POISON = {  # group id: (message, the start of the reason it is dead-lettered for)
    "nan-reward": (
        group("nan-reward", reward=float("nan")),
        "group nan-reward from generator 7: sample 0: reward is nan",
    ),
    "too-long": (
        group("too-long", tokens=[5] * 41, mask=[0] * 40 + [1], logprobs=[0.0] * 41, versions=[-1] * 40 + [0]),
        "group too-long from generator 7: sample 0: 41 tokens, more than model.maxSeqLen (40)",
    ),
    "future": (
        group("future", versions=[-1, -1, 0, 1_000_000]),
        "group future from generator 7: sample 0: version 1000000 at token 3 is ahead of the trainer",
    ),
    "nan-logprob": (
        group("nan-logprob", logprobs=[0.0, 0.0, float("nan"), -0.7]),
        "group nan-logprob from generator 7: sample 0: logprob nan at token 2",
    ),
}


def test_poison_rollouts_are_dead_lettered_and_the_job_finishes(live, capsys):
    run = live
    run.wait_step(2)
    subjects = JobSubjects(JOB)

    async def publish(vocab: str | None = None) -> None:
        nc = await connect(run.services()["nats-server"]["url"], "forger")
        js = nc.jetstream()
        if vocab is None:
            for gid, (msg, _) in POISON.items():
                await js.publish(subjects.rollouts(FORGER), m.encode(msg), headers={"Nats-Msg-Id": gid})
            await js.publish(subjects.rollouts(FORGER), b"\x93not msgpack")
        else:  # sound to the preprocessor, and as fresh as the real groups arriving with it
            announced = await last_message(js, subjects.stream("CONTROL"), subjects.version)
            # Weights v + 1 exist once v is announced (sent before); the pause lets the
            # preprocessor see the announcement too, or v + 1 would be ahead of the trainer.
            await asyncio.sleep(0.3)
            v = m.decode(announced, m.PolicyVersion).version + 1
            await js.publish(
                subjects.rollouts(FORGER),
                m.encode(group(vocab, tokens=[5, 6, 10**6, 8], versions=[-1, -1, v, v])),
                headers={"Nats-Msg-Id": vocab},
            )
        await nc.close()

    asyncio.run(publish())
    # A token the model has no embedding for: the trainer's check. The group queues behind the
    # real generator's and may come too old to the step it would go into: then it is dropped
    # as stale (not dead-lettered), and a fresh copy is sent until one is trained.
    logs = run.dir / "logs"
    for attempt in range(5):
        vocab = f"vocab-{attempt}"
        asyncio.run(publish(vocab))
        deadline = time.monotonic() + 60
        while f"(group {vocab})" not in (logs / "trainer.log").read_text():
            if f"group {vocab} from generator {FORGER}: too old" in (logs / "preprocessor.log").read_text():
                break
            assert time.monotonic() < deadline, f"{vocab}: neither trained nor dropped as stale in 60 s"
            time.sleep(0.2)
        else:
            break
    else:
        raise AssertionError("5 copies of the vocab group in a row came too old to their step")
    run.finish()  # exit 0: every step trained, and the newest ones learn
    train = run.train()
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["tokens"] > 0 for r in train)  # the step with the bad sample trained the others
    assert sum(r["samples_rejected"] for r in train) == 1
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["samples_rejected"] == 1 and summary["learning_alarm"] is None

    letters = stored(run.dir, JOB, "DEADLETTER")
    rollouts = [x for x in letters if x.subject == subjects.deadletter("rollout")]
    reasons = sorted(x.headers[DEADLETTER_REASON] for x in rollouts)
    assert len(reasons) == len(POISON) + 1  # each once, however often it was seen
    for gid, (_, expected) in POISON.items():
        assert any(r.startswith(expected) for r in reasons), (gid, reasons)
    assert any(r.startswith("rollout_group: not valid msgpack") for r in reasons)
    (batch,) = [x for x in letters if x.subject == subjects.deadletter("batch")]
    assert f"(group {vocab}): token id 1000000 is outside the model's vocabulary" in batch.headers[DEADLETTER_REASON]
    assert 10**6 in m.decode(batch.data, m.MicroBatch).tokens  # the micro-batch as it came, for inspection
    # `pipelinerl dead-letters` lists them for the user, reasons first.
    from pipelinerl_cli.main import main

    assert main(["dead-letters", str(run.dir.parent / "job.yaml"), "--run-dir", str(run.dir)]) == 0
    listed = capsys.readouterr()
    assert f"6 dead letter(s) for job '{JOB}'" in listed.err
    assert " rollout: group nan-reward from generator 7: sample 0: reward is nan" in listed.out
    assert " batch: sample " in listed.out
    pre = (run.dir / "logs" / "preprocessor.log").read_text()
    assert pre.count("dead-lettered") == len(POISON) + 1 and "Traceback" not in pre
