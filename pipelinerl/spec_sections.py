"""The `PipelineRLJob` spec's sections beside its roles: the model, the task, the RL method, the
weight transfer, evaluation, the run policy, scheduling, NATS, the network, storage, tracking and
the output."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelinerl.contracts import HTTP_PORT, MASTER_PORT, WEIGHTS_PORT
from pipelinerl.k8s_types import (
    NATS_URL,
    DnsSubdomain,
    PositiveQuantity,
)
from pipelinerl.spec_base import (
    BUILTIN_MODELS,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MODEL_PATH_PLACED,
    TASK_IMPORT_PATH,
    TASK_NAMES,
    SpecModel,
)


class ModelSpec(SpecModel):
    path: str = Field(
        default="builtin:tiny-arith",
        min_length=1,
        max_length=1024,
        description="A Hugging Face model folder by its absolute path (in a cluster: on a volume the pod template "
        "mounts), a hub id (Qwen/Qwen2.5-0.5B), or builtin:tiny-arith / builtin:tiny-chain (their warm-started "
        "weights ship with the package) / builtin:tiny-random.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weights' dtype in the generators and the trainer; auto: bfloat16 where the job has GPUs, "
        "float32 on CPU.",
    )
    max_seq_len: int = Field(default=64, ge=8, le=131072, description="Prompt + completion tokens.")

    @field_validator("path")
    @classmethod
    def _placed(cls, v: str) -> str:
        if v.startswith("builtin:") and v not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {v!r}: {', '.join(BUILTIN_MODELS)}")
        # No hub id starts with . or ~, nor has two slashes (org/name); a URI (s3://) is vLLM's.
        if v.startswith((".", "~")) or not (v.startswith("/") or "://" in v or v.count("/") < 2):
            raise ValueError(MODEL_PATH_PLACED)
        return v


class TaskSpec(SpecModel):
    name: str = Field(
        default="arith",
        min_length=1,
        max_length=128,
        description=f"A built-in task ({', '.join(TASK_NAMES)}) or module.path:Class.",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Task-specific parameters.")
    seed: int = Field(default=0, ge=0, le=MAX_SEED, description="Seed of the task's problem order and held-out set.")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in TASK_NAMES and not re.fullmatch(TASK_IMPORT_PATH, v):
            raise ValueError(f"unknown task {v!r}: a built-in ({', '.join(TASK_NAMES)}) or module.path:Class")
        return v


class RLSpec(SpecModel):
    loss: Literal["reinforce", "ppo", "gspo", "cispo"] = Field(
        default="reinforce",
        description="reinforce: truncated-IS REINFORCE (the reference's); ppo: PPO-clip; gspo: sequence-level ratio, "
        "each sample's term its tokens' mean; cispo: the IS weight on the log-prob clipped above only (ScaleRL, "
        "MiniMax-M1: reinforce's term under the name those papers give it).",
    )
    attempts: int = Field(default=8, ge=2, le=1024, description="Samples per prompt (group size G).")
    max_lag: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Max policy versions between generation and training; default 4 (pipeline); in sync mode "
        "it is stepsPerGeneration - 1 (the phase's last step trains on data that many versions old).",
    )
    steps_per_generation: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Sync mode (the conventional baseline): optimizer steps taken on each generation phase (k). "
        "A phase generates k x trainer.samplesPerStep samples with the current weights, then the trainer takes k "
        "steps on consecutive mini-batches of it (step j of the phase trains at lag j) and sends the weights once. "
        "1 in pipeline mode.",
    )
    epsilon_low: float = Field(
        default=0.2,
        ge=0.0,
        le=10.0,
        description="Lower clip of the ratio, 1 - epsilonLow (ppo and gspo; reinforce and cispo have none).",
    )
    epsilon_high: float = Field(
        default=0.2, ge=0.0, le=100.0, description="Upper clip or truncation of the ratio: 1 + epsilonHigh."
    )
    importance_weights: Literal["token", "sequence"] = Field(
        default="token",
        description="Off-policy weight of the reinforce and cispo losses, truncated at 1 + epsilonHigh: each "
        "token's own ratio (token), or its sample's product of ratios (sequence), which also corrects "
        "for how likely the token's prefix was.",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of a k3 KL penalty to the initial model (0: none). Above 0 every trainer rank "
        "holds a whole copy of the initial model on its GPU, under ZeRO-3 too.",
    )
    entropy_coef: float = Field(default=0.0, ge=0.0, description="Weight of an entropy bonus (0: none).")
    normalize_advantages: bool = Field(default=False, description="Divide advantages by group std.")
    filter_zero_variance: bool = Field(default=True, description="Drop groups whose rewards are all equal.")
    token_weighting: Literal["sample", "token"] = Field(
        default="sample", description="sample: each token weighs 1/samples per step; token: 1/tokens per step."
    )


class WeightSyncSpec(SpecModel):
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: NCCL with GPUs, else gloo.")
    bucket_mb: int = Field(default=256, ge=1, le=65536, description="Flat buffer size of one broadcast.")
    timeout_seconds: float = Field(
        default=120.0,
        gt=0.0,
        le=86400.0,
        description="Bound of every weight-sync wait; a generator past it is dropped, not waited for. Also how "
        "long trainer ranks wait for one that stopped answering before all restart from the checkpoint.",
    )
    port: int = Field(default=WEIGHTS_PORT, ge=1024, le=65535, description="Trainer rank 0's weight rendezvous port.")
    staged: bool = Field(
        default=True,
        description=(
            "Generators receive and load new weights into a staging copy while they keep generating, "
            "then pause only to copy them in (one extra copy of the weights in generator memory; a failed "
            "transfer keeps the live weights). false: received straight into the live weights inside the "
            "pause (a transfer failing midway restarts the generator). Models vLLM post-processes after "
            "loading (quantized, MLA, some MoE kernels) always take vLLM's layerwise reload inside the pause."
        ),
    )

    @field_validator("port")
    @classmethod
    def _port_free(cls, v: int) -> int:
        taken = {HTTP_PORT: "every service's HTTP port", MASTER_PORT: "the trainer ranks' rendezvous port"}
        if v in taken:
            raise ValueError(f"weightSync.port {v} is {taken[v]}")
        return v


class EvalSpec(SpecModel):
    interval: int = Field(default=10, ge=0, le=MAX_STEPS, description="Evaluate every N policy versions; 0 disables.")
    problems: int = Field(default=1000, ge=1, le=1_000_000, description="Held-out problems per evaluation (greedy).")


class RunPolicy(SpecModel):
    backoff_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Failures (pod restarts of the failingRoles, per incident) beyond which the job fails.",
    )
    failing_roles: list[Literal["trainer", "preprocessor", "generator"]] = Field(
        default=["trainer", "preprocessor"],
        max_length=3,
        description="Roles whose pod "
        "restarts count against backoffLimit. Generators are left out by default: the job goes on without any "
        "one of them (Degraded while some are missing), so a restarting generator degrades it, never fails it. "
        "`pipelinerl run` counts every process's restarts, each against backoffLimit.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, le=MAX_SECONDS, description="From creation; time suspended is not counted."
    )
    progress_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        le=MAX_SECONDS,
        description="No new policy version for this long while running: Ready and Progressing turn False.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=MAX_SECONDS, description="Delete the finished job this long after it ends."
    )
    checkpoint_retention: Literal["DeleteAfterOutput", "Retain", "Delete"] = Field(
        default="DeleteAfterOutput",
        description="The trainer volumes (checkpoints) when the job is deleted "
        "(ttlSecondsAfterFinished too): DeleteAfterOutput deletes them only once an output claim "
        "(spec.output.claimName) holds the final model (the job succeeded with one), else keeps them; Retain always "
        "keeps them; Delete never does.",
    )


class SchedulingSpec(SpecModel):
    scheduler_name: DnsSubdomain | None = Field(
        default=None, description="Pod scheduler; with a gang scheduler, the trainers and preprocessor form a PodGroup."
    )
    queue_name: DnsSubdomain | None = Field(default=None, max_length=63, description="Kueue LocalQueue name.")
    priority_class_name: DnsSubdomain | None = Field(default=None, description="PriorityClass of the job's pods.")


class NetworkSpec(SpecModel):
    egress: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description=(
            "Where the job's pods may connect besides their own job, NATS and DNS, as NetworkPolicy egress "
            "rules (to, ports), where the install restricts egress: e.g. the Hugging Face hub or W&B on port 443."
        ),
    )


# nats-server's file store refuses a record (the message, its subject and headers) of 32 MiB or
# more ("message too large", nats-server#6798), whatever its max_payload: the largest whole MiB a
# message and its headers stay under.
MAX_PAYLOAD_MB = 31


class NatsSpec(SpecModel):
    url: str | None = Field(
        default=None,
        max_length=1024,
        pattern=NATS_URL,
        description="nats:// or tls:// URL(s), comma-separated; unset: the chart's (a local run starts its own).",
    )
    max_payload_mb: int = Field(
        default=8,
        ge=1,
        le=MAX_PAYLOAD_MB,
        description=f"Largest NATS message (a micro-batch) in MiB; at most {MAX_PAYLOAD_MB}: JetStream stores no "
        "message of 32 MiB or more.",
    )


class StorageSpec(SpecModel):
    """The run directory (checkpoints, logs) of each trainer pod on Kubernetes: a PersistentVolumeClaim
    per trainer pod that survives suspend/resume; deleted with the job per runPolicy.checkpointRetention."""

    size: PositiveQuantity = Field(default="20Gi", description="Each trainer pod's checkpoint volume.")
    storage_class_name: DnsSubdomain | None = Field(
        default=None,
        description="Unset: the cluster default; on Kubernetes a named class must be one the platform "
        "lists (jobPolicy.storageClassNames).",
    )


class WandbSpec(SpecModel):
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(default=None, max_length=128, description="W&B entity (team or user).")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: files in the run directory (in a pod: the trainer's volume), for `wandb sync` later "
        "(online needs WANDB_API_KEY).",
    )
    tags: list[str] = Field(default_factory=list, max_length=64, description="W&B run tags.")


class MlflowSpec(SpecModel):
    tracking_uri: str | None = Field(
        default=None,
        max_length=1024,
        description="Unset: a SQLite store in the run directory (mlflow.db; in a pod: the trainer's volume).",
    )
    experiment: str | None = Field(default=None, max_length=256, description="Unset: the job's name.")


class TensorboardSpec(SpecModel):
    log_dir: str | None = Field(
        default=None,
        max_length=1024,
        description="Unset: tensorboard/ in the run directory (in a pod: the trainer's volume).",
    )


# The folders of a job's output folder (services/trainer/.../output.py): no job on an output claim
# is named as one, or its folder (<subPath>/<job name>) could be another job's final/ or best/.
OUTPUT_FOLDERS = ("final", "best")


class OutputSpec(SpecModel):
    """Where the trained model goes, outside the job's own volumes, so that it outlives the job:
    final/ (the last step's weights) and best/ (the trained version that scored highest on
    evaluation), Hugging Face folders with the tokenizer."""

    claim_name: DnsSubdomain | None = Field(
        default=None,
        description=(
            "Kubernetes: an existing PersistentVolumeClaim (not the job's: deleting the job leaves it), mounted "
            "into the trainer pods; ReadWriteMany when trainer.replicas > 1."
        ),
    )
    sub_path: str | None = Field(
        default=None,
        max_length=253,
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$",
        description=(
            "A folder inside the claim that the job's own folder (named by the job) goes in; unset: the claim's "
            "root. A job writes only under its own name, so no subPath reaches another job's model."
        ),
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="`pipelinerl run`: a folder on this machine (relative: to where it runs).",
    )
    best: bool = Field(default=True, description="Keep the best version on evaluation too (needs eval.interval).")

    @model_validator(mode="after")
    def _somewhere(self) -> OutputSpec:
        if self.claim_name is None and self.path is None:
            raise ValueError("output: set claimName (Kubernetes), path (pipelinerl run) or both")
        return self


class TrackingSpec(SpecModel):
    """Experiment trackers the trainer logs to: train rows at their step, evaluations at their
    policy version, under the names `metrics.jsonl` uses (prefixed train/ and eval/)."""

    wandb: WandbSpec | None = None
    mlflow: MlflowSpec | None = None
    tensorboard: TensorboardSpec | None = None
