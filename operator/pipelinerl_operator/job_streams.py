"""The operator's calls on a job's NATS streams (as the job's own NATS user, where it has one):
delete them (a deleted job's; a finished or suspended one's once its pods are gone), read the
trainer's newest checkpoint record first (what a suspended job resumes from), make a resumed
job's new store go on from it (`store.recover_store`), and tell whether a store was made so.

Bounded: each gives up after `timeout_s`. `JobStreams` tells each outcome in an Event and never
raises: the caller tries again at its next pass (or, for a deleted job, lets it go: the streams
are then left behind on the server).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from nats.js.errors import NotFoundError

from pipelinerl.contracts import JOB_LABEL, JobSubjects, OperatorEnv
from pipelinerl.messages import Checkpointed
from pipelinerl.streams import close, connect, delete_streams, last_checkpoint
from pipelinerl.store import made_from, recover_store
from pipelinerl_operator.config import OperatorConfig
from pipelinerl_operator.credentials import job_credentials
from pipelinerl_operator.status import parse_ts

T = TypeVar("T")


def own_nats_url(body: Mapping[str, Any]) -> str | None:
    return ((body.get("spec") or {}).get("nats") or {}).get("url")


# A restore's JetStream requests (`recover_store`): the identity read twice, five streams deleted,
# looked up and made, four records written (counted in tests/integration/test_streams.py).
RESTORE_REQUESTS = 21


# A pod still listed this long past its deletion time (its grace period's end) is taken for gone:
# a lost node's pods stay Terminating until the node controller gives up on them, and they reach
# no NATS meanwhile. Waited for, a finished or suspended job held its room in the store for good.
STUCK_TERMINATING_S = 180.0


def stuck_terminating(pod: Mapping[str, Any], now: datetime) -> bool:
    since = (pod.get("metadata") or {}).get("deletionTimestamp")
    return isinstance(since, str) and (now - parse_ts(since)).total_seconds() > STUCK_TERMINATING_S


@dataclass
class JobStreams:
    """One job's streams, as the operator reaches them (`body`: the job object), each outcome told
    through `event(type, reason, message)`."""

    body: Mapping[str, Any]
    cfg: OperatorConfig
    event: Callable[[str, str, str], None]
    logger: logging.Logger | logging.LoggerAdapter

    def __post_init__(self) -> None:
        meta = self.body["metadata"]
        self.name, self.namespace, uid = meta["name"], meta["namespace"], meta.get("uid", "")
        own = own_nats_url(self.body)
        # On the chart's NATS the streams live in the job's own account: reached as its user. On an
        # external one (the chart's disabled) there are no such accounts: reached as its pods reach it.
        key = self.cfg.auth_key if not own and self.cfg.nats_bundled else None
        creds = job_credentials(key, self.namespace, self.name, uid) if key else {}
        self.url, self.user, self.password = own or self.cfg.nats_url, creds.get("natsUser"), creds.get("natsPassword")
        self.replicas = self.cfg.nats_replicas if self.cfg.nats_replicas > 1 and not own else None
        self.timeout_s = float(os.environ.get(OperatorEnv.NATS_TIMEOUT, "10"))
        self.subjects = JobSubjects(self.name, self.namespace)

    async def _as_job(self, call: Callable[[Any], Awaitable[T]], requests: int = 1) -> T:
        """`call` on the job's JetStream, connected as the job; raises after `timeout_s` for each
        of the requests it makes (`requests`)."""

        async def run() -> T:
            short = min(3.0, self.timeout_s)
            nc = await connect(
                self.url, "pipelinerl-operator", self.user, self.password, reconnect=False, timeout_s=short
            )
            try:
                return await call(nc.jetstream(timeout=short))
            finally:
                await close(nc)

        return await asyncio.wait_for(run(), self.timeout_s * requests)

    async def delete(self) -> bool:
        """The streams deleted; False where NATS did not answer."""
        try:
            streams = await self._as_job(lambda js: delete_streams(js, self.subjects))
        except Exception as err:  # noqa: BLE001 - any NATS failure is told, never raised
            self.logger.warning("could not delete NATS streams of %s/%s: %r", self.namespace, self.name, err)
            self.event(
                "Warning",
                "StreamsDeleteFailed",
                f"could not delete NATS streams at {self.url}: {err!r} (they stay in the job's own account, which "
                "no later job gets; on the chart's NATS they hold their room until it restarts)",
            )
            return False
        self.event("Normal", "StreamsDeleted", f"deleted NATS streams: {', '.join(streams) or 'none'}")
        return True

    async def pods_gone(self, kube: Any) -> bool:
        """Whether none of the job's pods is left (those on their way out still use its streams),
        but those stuck Terminating (`stuck_terminating`)."""
        now = datetime.now(timezone.utc)
        return all(
            stuck_terminating(p, now) for p in await kube.list("v1", "Pod", self.namespace, f"{JOB_LABEL}={self.name}")
        )

    async def checkpoint_record(self, kube: Any) -> dict[str, Any] | None:
        """A suspended job's trainer's newest checkpoint record, which its resume restores the store
        from ({} where there is none), once its pods are gone (the trainer checkpoints on its way
        out). None: not yet."""
        if not await self.pods_gone(kube):
            return None
        try:
            told = await self._as_job(self._checkpoint_told)
        except Exception as err:  # noqa: BLE001 - told, and tried again next pass
            self.event("Warning", "StreamsDeleteFailed", f"could not read the trainer's checkpoint record: {err!r}")
            return None
        return told.model_dump(exclude_defaults=True) if told else {}

    async def _checkpoint_told(self, js: Any) -> Any:
        """The trainer's newest checkpoint record; None where the job has no streams (its services
        never made them). `last_checkpoint` retries a missing stream, a store being recovered."""
        try:
            await js.stream_info(self.subjects.stream("CONTROL"))
        except NotFoundError:
            return None
        return await last_checkpoint(js, self.subjects, self.timeout_s)

    async def restored_from(self, record: dict[str, Any]) -> bool | None:
        """Whether the job's store was made to go on from this checkpoint record (`restore`); None
        where NATS did not answer."""
        try:
            made = await self._as_job(lambda js: made_from(js, self.subjects, record["store"], record["step"]))
        except Exception as err:  # noqa: BLE001 - told; not known: the caller leaves the store as it is
            self.event("Warning", "StreamsDeleteFailed", f"could not read the NATS store's identity: {err!r}")
            return None
        return made is not None

    async def restore(self, job: Any, record: dict[str, Any]) -> str | None:
        """A resumed job's streams made again, going on from its trainer's checkpoint; why not yet."""
        try:
            told = Checkpointed.model_validate(record)
            # Each try starts over (a store cut short is made again whole): a bound a slow NATS
            # cluster always overran (each stream made or deleted is a consensus round there)
            # would hold the job suspended for good.
            await self._as_job(
                lambda js: recover_store(
                    js, self.subjects, job.spec, told.store, told.step, told.claims, self.replicas
                ),
                requests=RESTORE_REQUESTS,
            )
        except Exception as err:  # noqa: BLE001 - its account may not be on the server yet: next pass
            self.logger.info("restoring the NATS store of %s/%s: %r", self.namespace, self.name, err)
            return (
                f"its NATS store is being restored from its trainer's checkpoint (step {record['step']}) before "
                f"its pods start: {type(err).__name__}"
            )
        self.event(
            "Normal",
            "StoreRestored",
            f"the job's NATS store goes on from its trainer's checkpoint at step {record['step']}",
        )
        return None
