"""Every name and shape that two PipelineRL components must agree on, defined once.

Environment variables (what the operator and the local runner set, what the services read),
ports, labels and annotations, paths inside pods, stream and subject names, and the `/status`
body of each role. The bottom layer: it imports nothing from the project (see
docs/architecture.md), and `tests/unit/test_contracts.py` fails when another file spells one of
these names itself.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# ---------------------------------------------------------------- ports and paths

HTTP_PORT = 8000  # every service: /healthz, /readyz, /metrics, /status
MASTER_PORT = 29500  # trainer ranks: torch.distributed rendezvous
WEIGHTS_PORT = 29600  # trainer rank 0: weight-group rendezvous (weightSync.port's default)
OPERATOR_METRICS_PORT = 8080
OPERATOR_HEALTH_PORT = 8081
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
EVALUATING_GENERATOR = 0  # the generator that runs the held-out evaluations (the final one too)

JOB_FILE_DIR = "/etc/pipelinerl"  # in pods: the job manifest, from the job's ConfigMap
JOB_FILE = f"{JOB_FILE_DIR}/job.yaml"
POD_RUN_DIR = "/var/lib/pipelinerl/run"  # in pods: checkpoints and logs (a volume)
POD_OUTPUT_DIR = "/var/lib/pipelinerl/output"  # in trainer pods: spec.output's claim
POD_CACHE_DIR = "/var/cache/pipelinerl"  # in pods: built models, engine caches (a volume; the root fs is read-only)
POD_TMP_DIR = "/tmp"  # in pods: a volume, also HOME (libraries write under ~/.cache)
POD_USER = 10001  # the non-root user job pods run as (the images' own)
# A trainer rank's exit code where it stopped before the run's end (its signal, or another rank's:
# `pipelinerl_trainer.stopping`), its stop checkpoint written: started again, it resumes from
# there. Not a failure: the operator does not count it, the local runner restarts it.
STOPPED_EXIT = 75  # EX_TEMPFAIL
# A service told to stop (SIGTERM) has this long: a pod's grace period, the trainer's own bound on
# its stop (the ranks' vote and the stop checkpoint), and what a local run gives each service.
STOP_GRACE_S = 60
NATS_ACCOUNTS_FILE = "accounts.conf"  # the key of the operator's accounts Secret; the chart's NATS includes it

# ---------------------------------------------------------------- message sizes

# Encoded sizes per token, with a margin over what was measured (a micro-batch's token 36 bytes,
# a rollout's 17: msgpack of the token, its mask, logprob, version, advantage and weight).
BATCH_BYTES_PER_TOKEN = 48
ROLLOUT_BYTES_PER_TOKEN = 24
# What a micro-batch carries beside its tokens: the step's books (its groups' ids, filtered ones
# too, and every generator's books), with a wide margin over what a step of a few thousand groups takes.
BOOKS_BYTES = 1 << 20

# ---------------------------------------------------------------- labels and annotations

JOB_LABEL = "pipelinerl.dev/job"
ROLE_LABEL = "pipelinerl.dev/role"
CONFIG_HASH_ANNOTATION = "pipelinerl.dev/config-hash"
NATS_STORE_BOOKS_ANNOTATION = "pipelinerl.dev/nats-store"  # on the accounts Secret: the store's reservations
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (Kubernetes ≥ 1.28)
KUEUE_PREFIX = "kueue.x-k8s.io/"
KUEUE_QUEUE_LABEL = f"{KUEUE_PREFIX}queue-name"
KUEUE_POD_GROUP_LABEL = f"{KUEUE_PREFIX}pod-group-name"
KUEUE_POD_GROUP_COUNT_ANNOTATION = f"{KUEUE_PREFIX}pod-group-total-count"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"  # coscheduling-style gang schedulers
# Labels PipelineRL, Kueue and gang schedulers act on: set by the operator from the job's spec only
# (a pod of the job in another queue, another job's gang, at another Kueue priority).
RESERVED_LABEL_PREFIXES = ("pipelinerl.dev/", KUEUE_PREFIX, "scheduling.x-k8s.io/")
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"  # their PodGroup object (scheduler-plugins)

# ---------------------------------------------------------------- environment

ROLES = ("generator", "preprocessor", "trainer")
Role = Literal["generator", "preprocessor", "trainer"]


class Env:
    """Names of the variables a service process is started with (`ServiceEnv` reads and writes
    them) and of the few a user may set."""

    RANK = "PIPELINERL_RANK"  # pod index (trainer pods: of the pod; pipelinerl_cli.pod_ranks derives each rank's)
    WORLD_SIZE = "PIPELINERL_WORLD_SIZE"
    RANKS_PER_POD = "PIPELINERL_RANKS_PER_POD"
    LOCAL_RANK = "PIPELINERL_LOCAL_RANK"
    NATS_URL = "PIPELINERL_NATS_URL"
    WEIGHTS_ADDR = "PIPELINERL_WEIGHTS_ADDR"
    RUN_DIR = "PIPELINERL_RUN_DIR"
    OUTPUT_DIR = "PIPELINERL_OUTPUT_DIR"  # trainers: where spec.output goes (unset: no output)
    HTTP_PORT = "PIPELINERL_HTTP_PORT"
    LISTEN_HOST = "PIPELINERL_LISTEN_HOST"  # the address a service's ports listen on (unset: every one)
    EXIT_WHEN_DONE = "PIPELINERL_EXIT_WHEN_DONE"
    TORCH_THREADS = "PIPELINERL_TORCH_THREADS"
    # The job's credentials (on Kubernetes from the job's Secret, never in its ConfigMap)
    NATS_USER = "PIPELINERL_NATS_USER"
    NATS_PASSWORD = "PIPELINERL_NATS_PASSWORD"
    WEIGHTS_TOKEN = "PIPELINERL_WEIGHTS_TOKEN"
    STREAM_REPLICAS = "PIPELINERL_STREAM_REPLICAS"  # JetStream copies of the job's streams (a NATS cluster)
    # torch.distributed's own names, for the trainer ranks' default group
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    TORCH_RANK = "RANK"
    TORCH_WORLD_SIZE = "WORLD_SIZE"
    TORCH_LOCAL_RANK = "LOCAL_RANK"
    # a user's knobs, never set by PipelineRL
    LOG_LEVEL = "PIPELINERL_LOG_LEVEL"
    DATA_TIMEOUT_S = "PIPELINERL_DATA_TIMEOUT_S"
    ACK_WAIT_S = "PIPELINERL_ACK_WAIT_S"  # the preprocessor's: a held group is delivered again after it
    CACHE = "PIPELINERL_CACHE"
    # tests only: the process kills itself (SIGKILL) at the failure point of this name (`runtime.failpoint`)
    FAILPOINT = "PIPELINERL_FAILPOINT"
    HOME = "HOME"  # set in pods to a writable volume


class OperatorEnv:
    """The operator's settings (the Helm chart's values become these)."""

    WATCH_NAMESPACES = "PIPELINERL_WATCH_NAMESPACES"
    SERVICES_IMAGE = "PIPELINERL_SERVICES_IMAGE"
    SERVICES_GPU_IMAGE = "PIPELINERL_SERVICES_GPU_IMAGE"
    IMAGE_PULL_POLICY = "PIPELINERL_IMAGE_PULL_POLICY"
    DEFAULT_NATS_URL = "PIPELINERL_DEFAULT_NATS_URL"
    JOB_SERVICE_ACCOUNT = "PIPELINERL_JOB_SERVICE_ACCOUNT"
    RESYNC_SECONDS = "PIPELINERL_RESYNC_SECONDS"
    METRICS_PORT = "PIPELINERL_METRICS_PORT"
    LIVENESS = "PIPELINERL_LIVENESS"
    DEBUG = "PIPELINERL_DEBUG"
    KUBE_SERVER = "PIPELINERL_KUBE_SERVER"  # tests and `kubectl proxy`: talk to this API server
    TRAINER_STATUS_URL = "PIPELINERL_TRAINER_STATUS_URL"  # tests: where the trainer's /status is
    NATS_TIMEOUT = "PIPELINERL_NATS_TIMEOUT"
    WEBHOOK_PORT = "PIPELINERL_WEBHOOK_PORT"  # unset: no admission webhook server
    WEBHOOK_CERT_DIR = "PIPELINERL_WEBHOOK_CERT_DIR"  # tls.crt and tls.key; unset: plain HTTP (tests)
    AUTH_KEY = "PIPELINERL_AUTH_KEY"  # the install's secret key: per-job credentials derive from it
    NATS_ACCOUNTS_SECRET = "PIPELINERL_NATS_ACCOUNTS_SECRET"  # the Secret the chart's NATS includes
    NAMESPACE = "PIPELINERL_NAMESPACE"  # the operator's own (where that Secret lives)
    SERVICE_ACCOUNT = "PIPELINERL_SERVICE_ACCOUNT"  # the operator's own: only it may drop its finalizer
    METRICS_NAMESPACES = "PIPELINERL_METRICS_NAMESPACES"  # comma-separated: may scrape job pods
    NATS_REPLICAS = "PIPELINERL_NATS_REPLICAS"  # servers of the chart's NATS (a JetStream cluster when > 1)
    NATS_STORE_BYTES = "PIPELINERL_NATS_STORE_BYTES"  # its JetStream store (max_file_store), per server
    NATS_MAX_PAYLOAD_MB = "PIPELINERL_NATS_MAX_PAYLOAD_MB"  # its max_payload: jobs on it may ask no more
    NATS_RETIRE_SECONDS = "PIPELINERL_NATS_RETIRE_SECONDS"  # a given-back account's time disabled (tests)
    JOB_EGRESS = "PIPELINERL_JOB_EGRESS"  # "restricted" (default) or "open": job pods' egress
    JOB_POLICY = "PIPELINERL_JOB_POLICY"  # JSON: what jobs may ask for (the chart's jobPolicy; job_policy.JobPolicy)
    INSTALL_SECRETS = "PIPELINERL_INSTALL_SECRETS"  # comma-separated: the install's Secrets, which no job may name
    NATS_BUNDLED = "PIPELINERL_NATS_BUNDLED"  # "false": the chart's NATS is an external server (nats.externalUrl)
    NATS_EXTERNAL_CIDRS = "PIPELINERL_NATS_EXTERNAL_CIDRS"  # comma-separated: where that server is (job egress)
    PEERING = "PIPELINERL_PEERING"  # kopf's peering object: replicas take turns reconciling (unset: one replica)
    PEERING_LIFETIME = "PIPELINERL_PEERING_LIFETIME"  # seconds a silent replica keeps its turn (takeover time)


@dataclass(frozen=True)
class ServiceEnv:
    """What one service process is told by whoever starts it (the operator's pod template or the
    local runner): both build one and write it with `to_environ`; the service reads it back
    with `from_environ`. Fields left None are not set (trainer-only ones on other roles)."""

    role: str
    rank: int = 0
    nats_url: str = DEFAULT_NATS_URL
    weights_addr: str = f"127.0.0.1:{WEIGHTS_PORT}"  # host:port of trainer rank 0's weight group
    run_dir: Path = Path("runs")
    output_dir: Path | None = None  # trainers: spec.output's folder
    http_port: int = HTTP_PORT  # 0: any free port (extra ranks of a multi-GPU trainer pod)
    # Set by the local runner only (a user may set them on a cluster):
    # where a service's ports (HTTP, the trainer's weight rendezvous) listen: unset, every
    # address (a pod's); a local run's loopback only (a laptop's run is not served to its network)
    listen_host: str | None = None
    exit_when_done: bool | None = None  # exit once finished; in a StatefulSet a finished service stays up
    torch_threads: int | None = None  # compute threads: the trainer's torch threads, a generator engine's (unset: 1)
    world_size: int | None = None  # trainers: DeepSpeed ranks in all (generators need no count: elastic)
    local_rank: int | None = None  # trainers: the GPU of their pod this rank uses
    ranks_per_pod: int | None = None  # trainers: rank processes the pod starts (one per GPU)
    master_addr: str | None = None  # trainers: torch.distributed rendezvous of the ranks
    master_port: int | None = None
    # Credentials (JOB_SECRET_KEYS): unset, NATS is reached without them and the weight group's
    # proofs use an empty token (the local runner draws a token per run; its embedded NATS
    # listens on loopback only).
    nats_user: str | None = None
    nats_password: str | None = None
    weights_token: str | None = None
    stream_replicas: int | None = None  # on a JetStream cluster: copies of each stream (unset: 1)

    _NAMES = {
        "rank": Env.RANK,
        "world_size": Env.WORLD_SIZE,
        "nats_url": Env.NATS_URL,
        "weights_addr": Env.WEIGHTS_ADDR,
        "run_dir": Env.RUN_DIR,
        "output_dir": Env.OUTPUT_DIR,
        "http_port": Env.HTTP_PORT,
        "listen_host": Env.LISTEN_HOST,
        "exit_when_done": Env.EXIT_WHEN_DONE,
        "torch_threads": Env.TORCH_THREADS,
        "local_rank": Env.LOCAL_RANK,
        "ranks_per_pod": Env.RANKS_PER_POD,
        "master_addr": Env.MASTER_ADDR,
        "master_port": Env.MASTER_PORT,
        "nats_user": Env.NATS_USER,
        "nats_password": Env.NATS_PASSWORD,
        "weights_token": Env.WEIGHTS_TOKEN,
        "stream_replicas": Env.STREAM_REPLICAS,
    }

    @property
    def listen_address(self) -> str:
        return self.listen_host or "0.0.0.0"

    @property
    def weights_host(self) -> str:
        return self.weights_addr.rpartition(":")[0] or "127.0.0.1"

    @property
    def weights_port(self) -> int:
        return int(self.weights_addr.rpartition(":")[2])

    def to_environ(self) -> dict[str, str]:
        out = {}
        for field, name in self._NAMES.items():
            value = getattr(self, field)
            if value is not None:
                out[name] = str(int(value)) if isinstance(value, bool) else str(value)
        return out

    @classmethod
    def from_environ(
        cls, role: str, environ: Mapping[str, str] = os.environ, defaults: ServiceEnv | None = None
    ) -> ServiceEnv:
        """The variables in `environ` over `defaults` (else the built-in defaults); a malformed
        value is an error naming the variable."""
        base = defaults or cls(role)
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for field, name in cls._NAMES.items():
            raw = environ.get(name)
            if raw in (None, ""):
                continue
            kind = types[field]
            try:
                if "bool" in kind:
                    values[field] = raw not in ("0", "false", "False")
                elif "int" in kind:
                    values[field] = int(raw)
                elif "Path" in kind:
                    values[field] = Path(raw)
                else:
                    values[field] = raw
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind}") from None
        return dataclasses.replace(base, role=role, **values)


# The job's Secret (`<job>-credentials`, created by the operator): its keys, and the variable each feeds.
JOB_SECRET_KEYS = {"natsUser": Env.NATS_USER, "natsPassword": Env.NATS_PASSWORD, "weightsToken": Env.WEIGHTS_TOKEN}


def reserved_env() -> frozenset[str]:
    """Variables PipelineRL sets itself: a user's env or pod template may not override them."""
    own = set(ServiceEnv._NAMES.values()) - {Env.EXIT_WHEN_DONE, Env.TORCH_THREADS, Env.LISTEN_HOST}
    return frozenset(own | {Env.TORCH_RANK, Env.TORCH_WORLD_SIZE, Env.TORCH_LOCAL_RANK})


# ---------------------------------------------------------------- streams and subjects

STREAM_SUFFIXES = ("ROLLOUTS", "BATCHES", "CONTROL", "METRICS", "DEADLETTER")
DEADLETTER_REASON = "Pipelinerl-Reason"  # header of a dead letter: why it was rejected


_NAME_TOKEN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class JobSubjects:
    """NATS subjects and JetStream stream names of one job, named by its namespace and its name:
    `prl.<namespace>.<job>.…` and `PRL_<NAMESPACE>_<JOB>_<SUFFIX>`, so two jobs of one name in two
    namespaces share none. Both are DNS labels (no '.', '_', '*' or '>'), so no two jobs' names
    collide and no name is a wildcard."""

    job: str
    namespace: str = "default"

    def __post_init__(self) -> None:
        for what, value in (("job name", self.job), ("namespace", self.namespace)):
            if not _NAME_TOKEN.fullmatch(value):
                raise ValueError(f"{what} {value!r}: not a DNS label (lowercase letters, digits, '-')")

    @property
    def _token(self) -> str:
        return f"{self.namespace}.{self.job}"

    def stream(self, suffix: str) -> str:
        if suffix not in STREAM_SUFFIXES:
            raise ValueError(f"unknown stream {suffix!r} (one of {', '.join(STREAM_SUFFIXES)})")
        return f"PRL_{self.namespace}_{self.job}_{suffix}".upper()

    @property
    def streams(self) -> list[str]:
        return [self.stream(s) for s in STREAM_SUFFIXES]

    def rollouts(self, generator: int | str) -> str:
        """One subject per generator: its newest group not yet consumed carries its books (GeneratorBooks)."""
        return f"prl.{self._token}.rollouts.{generator}"

    def batches(self, rank: int | str) -> str:
        return f"prl.{self._token}.batches.{rank}"

    @property
    def version(self) -> str:
        return f"prl.{self._token}.control.version"

    @property
    def problems(self) -> str:
        """The next training problem no generator has claimed (`streams.claim_problems`)."""
        return f"prl.{self._token}.control.problems"

    def held(self, generator: int | str) -> str:
        """The training problems a generator holds (`streams.hold_problems`): a record per rank."""
        return f"prl.{self._token}.control.held.{generator}"

    @property
    def store(self) -> str:
        """Which store the streams are (`messages.StoreIdentity`, `store.store_identity`)."""
        return f"prl.{self._token}.control.store"

    @property
    def checkpoint(self) -> str:
        """The trainer's newest checkpoint (`messages.Checkpointed`)."""
        return f"prl.{self._token}.control.checkpoint"

    @property
    def sent(self) -> str:
        """The newest version trainer rank 0 began to broadcast (`messages.WeightsSent`)."""
        return f"prl.{self._token}.control.sent"

    def metrics(self, kind: str | None = None) -> str:
        return f"prl.{self._token}.metrics.{kind or '*'}"

    def deadletter(self, kind: str | None = None) -> str:
        """Rejected messages ("rollout", "batch"), kept with their reason for inspection."""
        return f"prl.{self._token}.deadletter.{kind or '*'}"

    # Core NATS (not persisted): the weight-update handshake is only meaningful live.
    @property
    def weights_update(self) -> str:
        return f"prl.{self._token}.weights.update"

    @property
    def weights_done(self) -> str:
        return f"prl.{self._token}.weights.done"

    @property
    def weights_hello(self) -> str:
        return f"prl.{self._token}.weights.hello"


# ---------------------------------------------------------------- /status bodies


class StatusBody(BaseModel):
    """camelCase JSON, as Kubernetes status fields are; unknown keys are refused (the operator leaves a
    trainer's out first: `progress.read_trainer_status`)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Progress(StatusBody):
    """Training progress: trainer rank 0 reports it, the operator copies it into `status.progress`."""

    step: int = Field(default=0, ge=0)
    version: int = Field(default=0, ge=0, description="Policy version (optimizer steps applied).")
    max_steps: int | None = Field(default=None, ge=0)
    samples: int = Field(default=0, ge=0)
    reward: float | None = None
    lag_mean: float | None = None
    lag_max: int | None = None
    tokens_per_second: float | None = None
    last_update: str | None = None
    # The weight group (elastic: one membership epoch per generator join, leave or drop)
    generators_in_group: int | None = Field(default=None, ge=0, description="Generators in the current epoch.")
    weight_epoch: int | None = Field(default=None, ge=0, description="Membership epochs opened.")
    generators_dropped: int | None = Field(
        default=None, ge=0, description="Dropped for a missed deadline or a failure."
    )
    groups_rejected: int | None = Field(
        default=None,
        ge=0,
        description="Rollout groups dead-lettered by the preprocessor (listed by `pipelinerl dead-letters`).",
    )
    samples_rejected: int | None = Field(
        default=None,
        ge=0,
        description="Samples the trainer's model could not take (dead-lettered with their micro-batch, not trained).",
    )
    learning_alarm: str | None = Field(
        default=None,
        description="Why the newest steps show no learning "
        "(no tokens trained, most samples dropped, a non-finite loss).",
    )


class TrainerStatus(Progress):
    role: Literal["trainer"] = "trainer"
    rank: int = 0
    finished: bool = False  # the last step is trained
    weight_sync_ready: bool = False  # rank 0: a weight group with at least one generator is formed
    store_lost: str = ""  # why the job's store is not the one its checkpoint's positions belong to
    store_unacknowledged: str = ""  # a publish JetStream left unacknowledged in the last 2 minutes


class GeneratorStatus(StatusBody):
    role: Literal["generator"] = "generator"
    rank: int = 0
    version: int = 0  # of the weights the engine holds
    groups_started: int = 0
    groups_finished: int = 0
    groups_published: int = 0  # every incarnation's
    groups_discarded: int = 0
    groups_trained: int = 0
    inflight_groups: int = 0
    queued_groups: int = 0
    tokens: int = 0
    updates_with_requests_in_flight: int = 0
    busy_seconds: float = 0.0
    first_group_at: float | None = None  # wall clock (Unix seconds) of this process's first group: generation began


class PreprocessorStatus(StatusBody):
    role: Literal["preprocessor"] = "preprocessor"
    next_step: int = 0
    trainer_version: int = 0
    pending_groups: int = 0
    steps: int = 0
    malformed: int = 0
    dead_lettered: int = 0  # malformed ones included
    stale_groups: int = 0  # too old for any step they could go into: dropped for lag
    filtered_groups: int = 0
    truncated_samples: int = 0
    settled_before: int = 0  # handed back after a restart, although settled with the newest stored step: not recounted
