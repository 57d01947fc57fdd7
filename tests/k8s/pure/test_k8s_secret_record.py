"""The record of the credentials Secret the operator made (`reconcile._record_secret`): unrecorded,
no later pass can tell it from someone else's, so a write the API server fails is tried again.
The API server is a stand-in (none runs here) that fails the status writes it is told to."""

from __future__ import annotations

import asyncio

import pytest

from pipelinerl_operator import reconcile
from pipelinerl_operator.kube import Conflict, KubeError
from pipelinerl_operator.reconcile import RECORD_TRIES, JobRef, Overtaken, _record_secret


class ApiServer:
    """Status writes of one job: `failures` are raised first, one per write, in order."""

    def __init__(self, *failures: BaseException) -> None:
        self.failures = list(failures)
        self.written: list[tuple[dict, str | None]] = []
        self.tries = 0

    async def write_status(self, api_version, kind, namespace, name, patch, version):
        self.tries += 1
        if self.failures:
            raise self.failures.pop(0)
        self.written.append((patch, version))
        return "8"


@pytest.fixture(autouse=True)
def quick(monkeypatch) -> None:
    monkeypatch.setattr(reconcile, "RECORD_BACKOFF_S", 0.001)


def ref() -> JobRef:
    return JobRef("team-a", "demo", "uid-1", version="7")


async def test_a_record_the_api_server_fails_is_written_on_a_later_try():
    api = ApiServer(KubeError(503, "etcd leader changed"), asyncio.TimeoutError())
    job = ref()
    await _record_secret(api, job, "demo-uid-1-creds")  # type: ignore[arg-type]
    assert api.written == [({"credentialsSecret": "demo-uid-1-creds"}, "7")]
    assert job.version == "8" and api.tries == 3


@pytest.mark.parametrize("failure", [KubeError(500, "down"), asyncio.TimeoutError()], ids=["refused", "timed-out"])
async def test_a_record_the_api_server_keeps_failing_is_an_answer_the_pass_reports(failure):
    """Told as the API server's answer (KubeError), whatever failed: `apply_owned` then reports it
    and the pass's own status write records the Secret."""
    api = ApiServer(*(failure for _ in range(RECORD_TRIES)))
    with pytest.raises(KubeError):
        await _record_secret(api, ref(), "s")  # type: ignore[arg-type]
    assert not api.written and api.tries == RECORD_TRIES


async def test_a_job_written_meanwhile_gets_the_record_whatever_its_version_and_the_pass_is_overtaken():
    api = ApiServer(Conflict(409, "the object has been modified"))
    with pytest.raises(Overtaken):
        await _record_secret(api, ref(), "s")  # type: ignore[arg-type]
    assert api.written == [({"credentialsSecret": "s"}, None)] and api.tries == 2


class CreatingApiServer(ApiServer):
    """Creates Secrets (409 where one of that name exists), the first create's answer lost
    (timed out) after the Secret was made, where told so."""

    def __init__(self, *existing: str, lose_first_answer: bool = False) -> None:
        super().__init__()
        self.secrets, self.lose = set(existing), lose_first_answer

    async def create(self, obj):
        name = obj["metadata"]["name"]
        if name in self.secrets:
            return False
        self.secrets.add(name)
        if self.lose:
            self.lose = False
            raise asyncio.TimeoutError()
        return True


def secret(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "team-a"}}


async def test_a_secret_whose_creates_answer_was_lost_is_this_jobs_on_the_next_pass():
    """The create timed out after the server made the Secret: the record says it is this job's,
    so the next pass (its create refused: it exists) uses it rather than refusing the job until
    someone deletes it. One that existed before the job is still refused."""
    api = CreatingApiServer(lose_first_answer=True)
    with pytest.raises(asyncio.TimeoutError):
        await reconcile.apply_owned(api, ref(), [secret("s")], None)  # type: ignore[arg-type]
    assert api.written == [({"credentialsSecret": "s"}, "7")]
    assert await reconcile.apply_owned(api, ref(), [secret("s")], "s") == (None, "s")  # type: ignore[arg-type]
    foreign = CreatingApiServer("s")
    stopped, made = await reconcile.apply_owned(foreign, ref(), [secret("s")], None)  # type: ignore[arg-type]
    assert "Secret s already exists and this job did not make it" in stopped and made is None
