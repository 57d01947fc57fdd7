"""One tiny job through `pipelinerl run`, watched, faulted, then fed poison (one run serves all
three tests: each run's start costs about a minute of the suite).

Watched: a real Prometheus scrapes every service's /metrics on loopback with the labels the
chart's PodMonitor gives job pods (namespace, pod, pipelinerl_dev_job, pipelinerl_dev_role), the
rules file loaded. Every data-plane dashboard query (template variables substituted) must return
series for the run, every alert rule must evaluate without error, every series an alert reads
must exist, and nothing fires for the healthy run. Not from a run: the job-state panels and
alerts read the operator's view of each PipelineRLJob (`pipelinerl_job_*`), others the
operator's own series (`pipelinerl_operator_*`) or the NATS pods' volume stats: the operator's are
driven by faults in tests/k8s/live/test_k8s_operator_alerts.py, and test_k8s_monitoring.py checks
them against its registry; the volume's by a full disk in tests/e2e/test_store_faults.py.

Faulted: real faults on the running services (a stopped preprocessor, a generator stopped short of
the weight sync's deadline and past it, a generator's engine core stalled while its process answers,
a generator's groups arriving far too old, poison), and
each job-pod alert's whole expression, with its thresholds and windows scaled to what a fault of
seconds reaches (promtool holds the thresholds themselves: tests/monitoring), returns series for
this job while its fault lasts and none in the healthy stretch before: a broken join or label
would leave it empty.

Then poisoned: no single message stops a job. Bad rollout groups published into the running
job's stream (with the project's own codec, as a buggy task or environment would) are
dead-lettered with their reason, and the run goes on and finishes every step."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest
from faults import stall_engine  # tests/e2e/faults.py
from jobs import RUN_TIMEOUT_S, stored, tiny_job  # tests/e2e/jobs.py

from prometheus_server import (
    DASHBOARD,
    Prometheus,
    alert_rules,
    held,
    job_scrape_config,
    rule_expr,
    vector_selectors,
)  # tests/prometheus_server.py
from bench.run_process import RunProcess
from pipelinerl import messages as m
from pipelinerl.contracts import DEADLETTER_REASON, JobSubjects
from pipelinerl.streams import connect, last_message

pytestmark = pytest.mark.slow
JOB, NAMESPACE = "watched", "local"
# Room after the watching (the run steps on meanwhile) for several copies of the vocab group.
STEPS = 150  # at about 0.2 s a step: room for the faults, then the poison
# A generator past it is dropped from the weight group: short, so that a fault of seconds does it.
SYNC_TIMEOUT_S = 6.0
SCRAPED_S = 3  # a fault's last effects scraped (every second) and in a short window's rate
FORGER = 7  # no such generator: the forged groups' credit cannot disturb a real one's admission
# Series that come from the operator (its own, and each job's state) or the NATS pods, not from a job's pods.
ELSEWHERE = re.compile(r"^(pipelinerl_job_|pipelinerl_operator_|pipelinerl_nats_volume_)")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The run the tests share, in file order: watched while healthy, faulted, then poisoned to its end."""
    tmp_path = tmp_path_factory.mktemp("watched")
    job = tiny_job(
        JOB,
        trainer={"maxSteps": STEPS},
        eval={"interval": 2, "problems": 16},
        rl={"maxLag": 3},
        weightSync={"timeoutSeconds": SYNC_TIMEOUT_S},
    )
    run = RunProcess(tmp_path, job, timeout_s=RUN_TIMEOUT_S)
    try:
        yield run
    finally:
        run.abandon()  # a test failed midway (a finished run: nothing left to stop)


@pytest.fixture(scope="module")
def prometheus(live, tmp_path_factory):
    """Scraping the run from its first services until the last test is done with it."""
    live.wait_until(lambda _: (live.dir / "services.json").exists(), "services.json")
    scrape = job_scrape_config(live.services(), NAMESPACE, JOB)
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), [scrape], interval_s=1.0)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def substituted(expr: str) -> str:
    """As Grafana sends it with this run chosen in the job and namespace variables."""
    return expr.replace("$namespace", NAMESPACE).replace("$job", JOB).replace("$__rate_interval", "1m")


def test_every_dashboard_query_and_alert_series_has_data_for_a_real_run(live, prometheus):
    run = live
    assert run.proc.poll() is None, "the shared run ended before it was watched: run this file in order"
    services = run.services()
    assert {s["role"] for s in services.values() if "http_port" in s} == {"generator", "preprocessor", "trainer"}
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
    assert {"Held-out accuracy", "ESS", "KL and entropy", "Lag of trained tokens", "Generator tokens/s"} <= set(checked)

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


# Each job-pod alert driven by a fault here: the changes that scale its thresholds and windows to
# a fault of seconds (each must be in the rule as written, or the test fails: a changed rule is
# looked at again here). The thresholds themselves are promtool's (tests/monitoring).
SCALED = {
    "PipelineRLJobStalled": [("> 900", "> 10")],  # a healthy step took over 5 s on a slow machine
    "PipelineRLLagOverBudget": [("[30m]", "[5s]")],
    "PipelineRLLearningAlarm": [],  # the trainer's own window (10 steps); `for:` is not in the expression
    "PipelineRLWeightSyncSlow": [("[30m]", "[3s]"), ("> 30", "> 1")],
    "PipelineRLWeightSyncFailures": [("[30m]", "[2m]"), ("> 3", "> 0")],
    "PipelineRLGeneratorOutOfWeightGroup": [],  # a count against the group's size; `for:` is not in it
    "PipelineRLStreamFilling": [("> 0.8", "> 0")],
    "PipelineRLDeadLetters": [("> 10", "> 3")],
}
# Scaled to a fault of seconds, these hold in a healthy run too, so only their series under the
# fault are checked (the join and the labels): a stream holds some bytes whenever the preprocessor
# lags (0.08% of ROLLOUTS' limit under load, 0.16% with it frozen: the generators' lag budget
# keeps a frozen preprocessor's backlog small), so no threshold tells the two apart at this scale.
HELD_WHEN_HEALTHY = {"PipelineRLStreamFilling"}
# Read from job pods but driven elsewhere: JetStream not acknowledging (a publish waits 30 s for
# its acknowledgement: tests/e2e/test_store_faults.py fills the store's disk).
NOT_HERE = {"PipelineRLStoreNotAcknowledging"}


def scaled(alert: str) -> str:
    expr = rule_expr(alert)
    for old, new in SCALED[alert]:
        assert old in expr, f"{alert}: {old!r} is not in its rule; look at its scaling again"
        expr = expr.replace(old, new)
    return expr


def freeze(run, name: str, seconds: float) -> None:
    """SIGSTOP a service (and what it started) for `seconds`, as a frozen pod would be."""
    pid = run.services()[name]["pid"]
    os.killpg(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.killpg(pid, signal.SIGCONT)


def stuck_generator(run, seconds: float, groups_per_wave: int = 40) -> None:
    """A generator stuck on old weights, as its groups reach the job: every half second a wave of
    groups sampled at version 0, long past rl.maxLag, forged with the project's codec as generator
    FORGER (no real generator here falls that far behind: its admission holds it within maxLag).
    The preprocessor drops them as too old; the trainer counts them dropped for lag."""

    async def publish() -> None:
        nc = await connect(run.services()["nats-server"]["url"], "stuck")
        js, subjects = nc.jetstream(), JobSubjects(JOB)
        try:
            for wave in range(round(seconds / 0.5)):
                for i in range(groups_per_wave):
                    gid = f"stuck-{wave}-{i}"
                    await js.publish(subjects.rollouts(FORGER), m.encode(group(gid)), headers={"Nats-Msg-Id": gid})
                await asyncio.sleep(0.5)
        finally:
            await nc.close()

    asyncio.run(publish())


def backlog(run, by_role: dict) -> None:
    """Steps waiting for the trainer (it frozen while the generator and the preprocessor go on), so
    that it steps, and sends weights, while the generator is frozen next: a generator-bound run
    would otherwise wait for data, not for the frozen generator's confirmation."""
    freeze(run, by_role["trainer"], 3)


def test_each_job_pod_alert_holds_under_its_fault_and_not_before(live, prometheus):
    run = live
    assert run.proc.poll() is None, "the shared run ended before its faults: run this file in order"
    by_role = {s["role"]: name for name, s in run.services().items()}
    start = time.time()
    run.wait_step(run.train()[-1]["step"] + 20)
    healthy = (start, time.time())  # stepping, nothing faulted
    windows = {}

    t0 = time.time()
    # No data: the trainer waits, ROLLOUTS holds the groups; longer than the preprocessor's 15 s
    # between reads of its streams' fill, so its first act on waking is to read them, and than
    # the stall's 10 s after the steps already stored are trained.
    freeze(run, by_role["preprocessor"], 22)
    time.sleep(SCRAPED_S)
    windows["PipelineRLJobStalled"] = windows["PipelineRLStreamFilling"] = (t0, time.time())

    run.wait_step(run.train()[-1]["step"] + 2)
    t0 = time.time()
    for _ in range(3):  # the fault taken: an update sent while the generator is frozen (on a loaded
        # machine the trainer may have no step ready then, and nothing waits on the confirmation)
        since = run.train()[-1]["step"]
        backlog(run, by_role)
        freeze(run, by_role["generator"], SYNC_TIMEOUT_S / 2)  # confirms an update late
        run.wait_step(since + 2)
        if any(r["step"] > since and r["weight_sync_seconds"] > 1 for r in run.train()):
            break
    time.sleep(SCRAPED_S)
    windows["PipelineRLWeightSyncSlow"] = (t0, time.time())

    t0 = time.time()
    for _ in range(3):  # the fault taken, as above: an update sent while the generator is frozen
        dropped = run.train()[-1]["generators_dropped"]  # so far
        backlog(run, by_role)
        freeze(run, by_role["generator"], SYNC_TIMEOUT_S + 4)  # past the deadline: dropped
        run.wait_step(run.train()[-1]["step"] + 3)  # back up, then joined again
        if run.train()[-1]["generators_dropped"] > dropped:
            break
    time.sleep(SCRAPED_S)
    windows["PipelineRLWeightSyncFailures"] = (t0, time.time())

    t0 = time.time()
    backlog(run, by_role)
    # Its process answers scrapes (up) and says hello, so the trainer invites it to each new epoch,
    # but the stalled core joins none: dropped, up and out of the group until the core goes on.
    out = scaled("PipelineRLGeneratorOutOfWeightGroup")
    stall_engine(
        run,
        by_role["generator"],
        until=lambda: any(float(s["value"][1]) >= SCRAPED_S for s in held(prometheus, out, t0, time.time())),
        weight_sync_timeout_s=SYNC_TIMEOUT_S,
    )
    run.wait_step(run.train()[-1]["step"] + 3)  # the core went on, and the generator joined again
    windows["PipelineRLGeneratorOutOfWeightGroup"] = (t0, time.time())

    t0 = time.time()
    stuck_generator(run, seconds=4)  # most of each step's samples too old: over budget, and the alarm
    time.sleep(SCRAPED_S)
    windows["PipelineRLLagOverBudget"] = windows["PipelineRLLearningAlarm"] = (t0, time.time())

    problems = []
    for alert, (start, end) in windows.items():
        fired = held(prometheus, scaled(alert), start, end)
        if not fired:
            problems.append(f"{alert}: no series during its fault: {scaled(alert)}")
        elif {(s["metric"].get("namespace"), s["metric"].get("pipelinerl_dev_job")) for s in fired} != {
            (NAMESPACE, JOB)
        }:
            problems.append(f"{alert}: series not of this job: {[s['metric'] for s in fired]}")
        if alert not in HELD_WHEN_HEALTHY and held(prometheus, scaled(alert), *healthy):
            problems.append(f"{alert}: holds in the healthy stretch before any fault")
    assert not problems, "\n".join(problems)
    # Every alert that reads job pods is driven here (dead letters: by the poison below) or said not to be.
    job_pod_alerts = {
        r["alert"] for r in alert_rules() if not any(ELSEWHERE.match(s) for s in vector_selectors(r["expr"]))
    }
    assert set(SCALED) | NOT_HERE == job_pod_alerts


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


def test_poison_rollouts_are_dead_lettered_and_the_job_finishes(live, prometheus, capsys):
    run = live
    run.wait_step(2)
    poisoned_at = time.time()
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
    time.sleep(3)  # scraped
    fired = held(prometheus, scaled("PipelineRLDeadLetters"), poisoned_at, time.time())
    assert [(s["metric"]["namespace"], s["metric"]["pipelinerl_dev_job"]) for s in fired] == [(NAMESPACE, JOB)]
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
