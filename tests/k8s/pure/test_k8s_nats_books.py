"""The NATS store's books (`nats_store.decide`, pure): who is admitted into the store, who keeps
room, when a given-back account retires and when it goes. The I/O around them (the accounts
Secret written on condition of its version, two operators deciding at once) is in
tests/k8s/live/test_k8s_nats_books_shared.py."""

from __future__ import annotations

from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.credentials import job_account
from pipelinerl_operator.nats_store import RETIRE_S, UNSEEN_S, Books, JobRecord, decide

GIB = 1 << 30
CFG = OperatorConfig(auth_key="k", nats_store_bytes=10 * GIB)  # the namespace share: 0.8 of it


def index(*jobs: tuple[str, str, str, int]) -> dict:
    """The operator's index of jobs (namespace, name, uid, what their status says they hold)."""
    return {(ns, n): [JobRecord(uid, held)] for ns, n, uid, held in jobs}


def test_a_job_is_admitted_only_where_the_held_room_leaves_it_room() -> None:
    seen = index(("team-a", "one", "u1", 0), ("team-b", "two", "u2", 0))
    problem, books = decide(Books(), seen, ("u1", "team-a", "one", 6 * GIB), CFG, now=0.0, retire_s=RETIRE_S)
    assert problem is None and books.held == {"u1": ("team-a", "one", 6 * GIB, 0.0)}
    problem, after = decide(books, seen, ("u2", "team-b", "two", 5 * GIB), CFG, now=1.0, retire_s=RETIRE_S)
    assert "cannot hold this job's streams (5.00 GiB) beside the running jobs' (6.00 GiB reserved)" in (problem or "")
    assert after == books  # it holds nothing, and nothing else changed
    problem, after = decide(books, seen, ("u2", "team-b", "two", 4 * GIB), CFG, now=1.0, retire_s=RETIRE_S)
    assert problem is None and set(after.held) == {"u1", "u2"}
    assert after.accounts(replicas=3) == [("team-a", "one", "u1", 18 * GIB), ("team-b", "two", "u2", 12 * GIB)]


def test_one_namespace_takes_no_more_than_its_share() -> None:
    seen = index(("team-a", "one", "u1", 0), ("team-a", "two", "u2", 0))
    _, books = decide(Books(), seen, ("u1", "team-a", "one", 5 * GIB), CFG, now=0.0, retire_s=0.0)
    problem, _ = decide(books, seen, ("u2", "team-a", "two", 4 * GIB), CFG, now=0.0, retire_s=0.0)
    assert "namespace team-a may reserve 80%" in (problem or "")


def test_a_running_job_whose_update_needs_more_than_there_is_keeps_what_it_holds() -> None:
    seen = index(("team-a", "one", "u1", 6 * GIB), ("team-b", "two", "u2", 3 * GIB))
    books = Books.from_statuses(seen, now=0.0)
    problem, after = decide(books, seen, ("u1", "team-a", "one", 8 * GIB), CFG, now=5.0, retire_s=RETIRE_S)
    assert problem and after == books
    problem, after = decide(books, seen, ("u1", "team-a", "one", 7 * GIB), CFG, now=5.0, retire_s=RETIRE_S)
    assert problem is None and after.held["u1"] == ("team-a", "one", 7 * GIB, 0.0)  # since its admission
    assert after.retired == {}  # its account goes on, with its new limit


def test_a_given_back_account_retires_holding_its_room_then_goes() -> None:
    """nats-server keeps an account's storage reserved when the account is dropped from its
    configuration (until it restarts), and releases it when the account's JetStream is disabled:
    a job's account is written disabled for RETIRE_S after its job gives its room back, its room
    counted as held meanwhile; a job holding room again is enabled again. (Checked on a real
    nats-server in tests/k8s/live/test_k8s_tenancy.py.)"""
    seen = index(("team-a", "one", "u1", 6 * GIB), ("team-b", "two", "u2", 0))
    books = Books.from_statuses(seen, now=0.0)
    problem, books = decide(books, seen, ("u1", "team-a", "one", 0), CFG, now=10.0, retire_s=RETIRE_S)
    one = job_account("team-a", "one", "u1")
    assert problem is None and books.held == {} and books.retired == {one: ("team-a", 6 * GIB, 10.0)}
    late = 10.0 + RETIRE_S - 1
    problem, after = decide(books, seen, ("u2", "team-b", "two", 5 * GIB), CFG, now=late, retire_s=RETIRE_S)
    assert "beside the running jobs' (6.00 GiB reserved)" in (problem or "")  # its room still counts
    problem, after = decide(books, seen, ("u1", "team-a", "one", 6 * GIB), CFG, now=late, retire_s=RETIRE_S)
    assert problem is None and after.retired == {} and "u1" in after.held  # resumed: enabled again
    problem, after = decide(books, seen, ("u2", "team-b", "two", 5 * GIB), CFG, now=10.0 + RETIRE_S, retire_s=RETIRE_S)
    assert problem is None and after.retired == {}  # gone: the room is the next job's
    _, unwritten = decide(Books.from_statuses(seen, 0.0), seen, ("u1", "team-a", "one", 0), CFG, now=1.0, retire_s=0.0)
    assert unwritten.retired == {}  # no accounts written (no install key): nothing to retire


def test_a_job_the_index_has_not_seen_keeps_its_room_a_while_then_is_taken_for_deleted() -> None:
    """Another replica admitted it a moment ago (this one's watch has not seen it yet), or it was
    deleted while no operator ran its finalizer: its room counts for UNSEEN_S, then retires."""
    books = Books({"u9": ("team-c", "gone", 7 * GIB, 100.0)})
    seen = index(("team-a", "one", "u1", 0))
    problem, after = decide(books, seen, ("u1", "team-a", "one", 4 * GIB), CFG, now=100.0 + UNSEEN_S - 1, retire_s=0.0)
    assert problem and after == books
    problem, after = decide(books, seen, ("u1", "team-a", "one", 4 * GIB), CFG, now=100.0 + UNSEEN_S, retire_s=0.0)
    assert problem is None and set(after.held) == {"u1"}


def test_the_books_read_back_as_written() -> None:
    books = Books({"u1": ("team-a", "one", 6 * GIB, 1.5)}, {"team-b.two.u2": ("team-b", GIB, 2.5)})
    assert Books.loads(books.dumps()) == books
    assert Books.from_statuses(index(("a", "x", "u1", 0), ("b", "y", "u2", 3)), now=4.0) == Books(
        {"u2": ("b", "y", 3, 4.0)}
    )


def test_a_job_needs_no_room_suspended_as_stored_whether_its_spec_reads_or_not() -> None:
    """A job whose spec no longer reads (a policy tightened since) keeps the room it holds while it
    runs; suspended (its stored spec says so: its pods are stopped all the same), it needs none,
    and its room goes back once its streams are gone. It kept it for good before, and a job waiting
    for room waited with it."""
    from pipelinerl.spec import parse_job
    from pipelinerl_operator.nats_store import store_bytes_needed

    cfg = OperatorConfig(nats_store_bytes=10 << 30)
    assert store_bytes_needed(None, {"phase": "Running"}, cfg, held=7, suspended=False) == 7
    assert store_bytes_needed(None, {"phase": "Running"}, cfg, held=7, suspended=True) == 0
    assert store_bytes_needed(None, {"phase": "Succeeded"}, cfg, held=7, suspended=False) == 0
    job = parse_job({"metadata": {"name": "j"}, "spec": {"suspend": True}})
    assert store_bytes_needed(job, {"phase": "Running"}, cfg, held=7, suspended=True) == 0


def test_the_operator_reaches_a_jobs_streams_as_its_pods_do() -> None:
    """On the chart's NATS as the job's own user (its account holds them); on an external NATS
    (the chart's disabled) or the job's own `nats.url`, as the URL says: no such user exists
    there, and the streams of a deleted job were left for a later job of its name."""
    import logging

    from pipelinerl_operator.job_streams import JobStreams

    def streams(bundled: bool, url: str | None = None) -> JobStreams:
        body = {"metadata": {"name": "j", "namespace": "ns", "uid": "u"}, "spec": {"nats": {"url": url}}}
        cfg = OperatorConfig(auth_key="k" * 32, nats_bundled=bundled, nats_url="nats://u:p@nats.example:4222")
        return JobStreams(body, cfg, lambda *_: None, logging.getLogger("test"))

    assert streams(bundled=True).user is not None
    external, own = streams(bundled=False), streams(bundled=True, url="nats://mine:4222")
    assert (external.user, external.password, external.url) == (None, None, "nats://u:p@nats.example:4222")
    assert (own.user, own.url) == (None, "nats://mine:4222")


def test_a_pod_stuck_terminating_past_its_grace_is_taken_for_gone() -> None:
    """A finished or suspended job's streams (and its room in the store) wait for its pods to go;
    a lost node's pods stay Terminating until the node controller gives up on them: one deleted
    more than STUCK_TERMINATING_S past its grace no longer holds the room for good."""
    from datetime import datetime, timedelta, timezone

    from pipelinerl_operator.job_streams import STUCK_TERMINATING_S, stuck_terminating

    now = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)

    def pod(deleted_s_ago: float | None) -> dict:
        when = None if deleted_s_ago is None else (now - timedelta(seconds=deleted_s_ago)).isoformat()
        return {"metadata": {"name": "p", "deletionTimestamp": when} if when else {"name": "p"}}

    assert not stuck_terminating(pod(None), now)  # running
    assert not stuck_terminating(pod(-30), now)  # in its grace
    assert not stuck_terminating(pod(STUCK_TERMINATING_S - 1), now)
    assert stuck_terminating(pod(STUCK_TERMINATING_S + 1), now)
