"""The `PipelineRLJob` resource: the single source of truth for one RL run.

The same models validate a manifest for `pipelinerl run` / `pipelinerl validate`, drive the
local supervisor and the services, and generate the CRD schema (`pipelinerl crd`). Field names
are camelCase in YAML (Kubernetes convention) and snake_case in Python.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pipelinerl.contracts import HTTP_PORT, MASTER_PORT, WEIGHTS_PORT, JobSubjects, reserved_env
from pipelinerl.engine_args import engine_arg_errors
from pipelinerl.k8s_types import (
    DNS_1035_LABEL,
    DNS_1123_LABEL,
    NATS_URL,
    RESOURCE_NAME,
    DnsSubdomain,
    ImageRef,
    PositiveQuantity,
    Quantity,
    parse_quantity,
)

API_GROUP = "pipelinerl.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "PipelineRLJob"

# The longest derived name, "<job>-prl-preprocessor", names a StatefulSet, whose pods carry the
# label controller-revision-hash "<statefulset>-<10-char hash>" (≤ 63): so 52 - 17 characters.
MAX_JOB_NAME = 35
# Integers are bounded as the API server bounds them (int64) and, where they feed libraries, as
# those do: seeds become numpy's and vLLM's (32 bits, with room for a seed per generator).
MAX_SEED = 2**31 - 1
MAX_STEPS = 10**9
MAX_SECONDS = 10**10
DNS_LABEL = re.compile(DNS_1035_LABEL)
TASK_NAMES = ("arith", "chain", "dataset", "guess", "math")  # pipelinerl.tasks.BUILTIN (a test keeps them equal)
TASK_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
GPU_RESOURCE = "nvidia.com/gpu"
# Fields a running job cannot change: the model, task and layout its checkpoints belong to, and
# the trainer's volume claim templates (a StatefulSet refuses changes to them).
IMMUTABLE = ("mode", "model", "task", "trainer.replicas", "trainer.gpus", "trainer.zeroStage", "storage")
# Env names the operator sets itself; a user template may not override them.
RESERVED_ENV = reserved_env()


class SpecModel(BaseModel):
    # strict: "4" is not 4, "yes" is not true (the API server refuses both; so do we).
    # Manifests are parsed by alias only (`parse_mapping`): maxSteps, never max_steps.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_assignment=True, strict=True
    )


class KeyRef(SpecModel):
    name: DnsSubdomain = Field(description="The Secret or ConfigMap, in the job's namespace.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    optional: bool | None = None


class EnvSource(SpecModel):
    """Where a value comes from, so that a secret never lands in the job, a ConfigMap or an annotation."""

    secret_key_ref: KeyRef | None = None
    config_map_key_ref: KeyRef | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("set exactly one of secretKeyRef, configMapKeyRef")
        return self


class EnvVar(SpecModel):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str | None = Field(default=None, max_length=4096)
    value_from: EnvSource | None = Field(default=None, description="A Secret or ConfigMap key (Kubernetes only).")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_ENV:
            raise ValueError(f"env name {v!r} is reserved (set by PipelineRL itself)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        return self


class Resources(SpecModel):
    """Kubernetes resource requests/limits: quantities as Kubernetes writes them (16, "500m", "16Gi")."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _names_and_bounds(self) -> Resources:
        for kind in ("requests", "limits"):
            for name in getattr(self, kind):
                if not re.match(RESOURCE_NAME, name):
                    raise ValueError(f"{kind}: {name!r} is not a resource name (cpu, memory, nvidia.com/gpu...)")
        for name, request in self.requests.items():
            if name in self.limits and parse_quantity(request) > parse_quantity(self.limits[name]):
                raise ValueError(f"requests.{name} ({request}) must not exceed limits.{name} ({self.limits[name]})")
        return self


class RoleSpec(SpecModel):
    """Fields every role shares: curated pod fields plus a pod-template passthrough."""

    image: ImageRef | None = Field(default=None, description="Container image; chart default when unset.")
    resources: Resources = Field(default_factory=Resources)
    gpus: int = Field(
        default=0,
        ge=0,
        le=16,
        description=("GPUs per pod (nvidia.com/gpu); a trainer pod runs one DeepSpeed rank per GPU."),
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64, description="Environment variables of the role's container."
    )
    pod_template: dict[str, Any] | None = Field(
        default=None,
        description="PodTemplateSpec merged under the generated pod (nodeSelector, tolerations, volumes...).",
    )

    @field_validator("env")
    @classmethod
    def _env_names_unique(cls, v: list[EnvVar]) -> list[EnvVar]:
        names = [e.name for e in v]
        if len(set(names)) != len(names):
            raise ValueError(f"env names must be unique; {sorted({n for n in names if names.count(n) > 1})} repeat")
        return v

    @field_validator("pod_template")
    @classmethod
    def _template_env_not_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # The operator merges the template under its own pod: a reserved env var there would
        # silently override rank/rendezvous wiring. (Its shape is checked against Kubernetes'
        # schema by pipelinerl_operator.admission.)
        pod_spec = (v or {}).get("spec")
        for kind in ("containers", "initContainers"):
            containers = pod_spec.get(kind) if isinstance(pod_spec, dict) else None
            for container in containers if isinstance(containers, list) else []:
                env = container.get("env") if isinstance(container, dict) else None
                for var in env if isinstance(env, list) else []:
                    if isinstance(var, dict) and var.get("name") in RESERVED_ENV:
                        raise ValueError(
                            f"podTemplate.spec.{kind}[{container.get('name', '?')}].env: "
                            f"env name {var['name']!r} is reserved (set by PipelineRL itself)"
                        )
        return v

    @model_validator(mode="after")
    def _gpus_once(self) -> RoleSpec:
        for kind in ("requests", "limits"):
            count = getattr(self.resources, kind).get(GPU_RESOURCE)
            if count is not None and parse_quantity(count) != self.gpus:
                raise ValueError(
                    f"resources.{kind}.{GPU_RESOURCE} ({count}) differs from gpus ({self.gpus}): "
                    f"set gpus only, PipelineRL requests the GPUs itself"
                )
        return self


class ModelSpec(SpecModel):
    path: str = Field(
        default="builtin:tiny-arith",
        min_length=1,
        max_length=1024,
        description="Hugging Face model folder (or hub id), or builtin:tiny-arith / builtin:tiny-chain (their "
        "warm-started weights ship with the package).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Weights' dtype in the generators and the trainer; auto: bfloat16 where the job has GPUs, "
        "float32 on CPU.",
    )
    max_seq_len: int = Field(default=64, ge=8, le=131072, description="Prompt + completion tokens.")


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
        if v not in TASK_NAMES and not re.match(TASK_IMPORT_PATH, v):
            raise ValueError(f"unknown task {v!r}: a built-in ({', '.join(TASK_NAMES)}) or module.path:Class")
        return v


class RLSpec(SpecModel):
    loss: Literal["reinforce", "ppo", "gspo", "cispo"] = Field(
        default="reinforce",
        description="reinforce: truncated-IS REINFORCE (the reference's); ppo: PPO-clip; gspo: sequence-level ratio; "
        "cispo: clipped IS weight on the log-prob (ScaleRL).",
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
    epsilon_low: float = Field(default=0.2, ge=0.0, le=10.0, description="Lower clip of the ratio: 1 - epsilonLow.")
    epsilon_high: float = Field(
        default=0.2, ge=0.0, le=100.0, description="Upper clip or truncation of the ratio: 1 + epsilonHigh."
    )
    importance_weights: Literal["token", "sequence"] = Field(
        default="token",
        description="Off-policy weight of the reinforce and cispo losses, truncated at 1 + epsilonHigh: each "
        "token's own ratio (token), or its sample's product of ratios (sequence), which also corrects "
        "for how likely the token's prefix was.",
    )
    kl_coef: float = Field(default=0.0, ge=0.0, description="Weight of a k3 KL penalty to the initial model (0: none).")
    entropy_coef: float = Field(default=0.0, ge=0.0, description="Weight of an entropy bonus (0: none).")
    normalize_advantages: bool = Field(default=False, description="Divide advantages by group std.")
    filter_zero_variance: bool = Field(default=True, description="Drop groups whose rewards are all equal.")
    token_weighting: Literal["sample", "token"] = Field(
        default="sample", description="sample: each token weighs 1/samples per step; token: 1/tokens per step."
    )


TOP_P_ERROR = (
    "topP below 1 is not supported: the trainer's policy is the full softmax at the sampling "
    "temperature, so a nucleus would bias every importance ratio by the nucleus's mass"
)


class SamplingSpec(SpecModel):
    temperature: float = Field(
        default=1.0, gt=0.0, le=10.0, description="Sampling temperature (the trainer divides logits by it too)."
    )
    top_p: float = Field(
        default=1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling threshold: only 1 (off) is supported, see the error below 1.",
    )
    max_tokens: int = Field(default=16, ge=1, le=131072, description="Completion tokens per attempt at most.")

    @field_validator("top_p")
    @classmethod
    def _no_nucleus(cls, v: float) -> float:
        if v < 1.0:
            raise ValueError(TOP_P_ERROR)
        return v


class GeneratorSpec(RoleSpec):
    replicas: int = Field(
        default=1, ge=1, le=1024, description="Generator pods (`kubectl scale` changes it; they join the weights live)."
    )
    tensor_parallel: int = Field(default=1, ge=1, le=16, description="GPUs per vLLM engine.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine arguments.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    max_inflight_groups: int = Field(default=64, ge=1, le=65536, description="Cap on concurrent prompt groups.")

    @field_validator("engine_args")
    @classmethod
    def _vllm_knows_them(cls, v: dict[str, Any]) -> dict[str, Any]:
        errors = engine_arg_errors(v)
        if errors:
            raise ValueError("; ".join(errors))
        return v

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> GeneratorSpec:
        tp = self.tensor_parallel
        if tp > 1 and (self.gpus < tp or self.gpus % tp):
            raise ValueError(
                f"generator.tensorParallel ({tp}) must divide generator.gpus ({self.gpus}): "
                f"each engine spans tensorParallel GPUs of its pod"
            )
        return self


class PreprocessorSpec(RoleSpec):
    max_pending_steps: int = Field(
        default=2, ge=1, le=64, description="Steps of batches published ahead of the trainer (backpressure)."
    )


class TrainerSpec(RoleSpec):
    replicas: int = Field(default=1, ge=1, le=1024, description="Trainer pods (DeepSpeed ranks: replicas x gpus).")
    zero_stage: Literal[0, 1, 2, 3] = Field(default=1, description="DeepSpeed ZeRO stage.")
    learning_rate: float = Field(default=1e-4, gt=0.0, le=1.0, description="AdamW learning rate.")
    warmup_steps: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description="Linear learning-rate warm-up; keeps Adam's first, large updates small.",
    )
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0.0, description="Gradient norm clip (0: none).")
    samples_per_step: int = Field(
        default=128, ge=1, le=1_000_000, description="Samples per optimizer step (B: prompts x rl.attempts)."
    )
    micro_batch_tokens: int = Field(
        default=4096, ge=8, le=10_000_000, description="Tokens per packed row (a micro-batch) per trainer rank."
    )
    max_steps: int = Field(default=100, ge=1, le=MAX_STEPS, description="Optimizer steps of the run.")
    checkpoint_interval: int = Field(
        default=50, ge=0, le=MAX_STEPS, description="Steps between checkpoints; 0: only at the end."
    )
    export_interval: int = Field(
        default=0,
        ge=0,
        le=MAX_STEPS,
        description=(
            "Save the Hugging Face weights every N policy versions (checkpoints/export/version-N; weights "
            "and tokenizer only) for offline evaluation; 0 disables."
        ),
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=MAX_SEED,
        description=("Trainer and generator seeds derive from it (generator i: seed + 1000·i), within 32 bits."),
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description=(
            "Recompute each layer's activations in the backward pass instead of keeping them: about a third "
            "more compute for a fraction of the activation memory (large models, long micro-batches)."
        ),
    )
    compile: bool = Field(
        default=False,
        description=(
            "torch.compile the decoder's MLPs and norms, fusing the elementwise work that eager mode runs op by op "
            "(GPUs; the first steps pay the compilation). Benchmark 6 measures what it gains."
        ),
    )

    @model_validator(mode="after")
    def _warmup_within_run(self) -> TrainerSpec:
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"trainer.warmupSteps ({self.warmup_steps}) must not exceed trainer.maxSteps ({self.max_steps})"
            )
        return self


class WeightSyncSpec(SpecModel):
    backend: Literal["auto", "nccl", "gloo"] = Field(default="auto", description="auto: NCCL with GPUs, else gloo.")
    bucket_mb: int = Field(default=256, ge=1, le=65536, description="Flat buffer size of one broadcast.")
    timeout_seconds: float = Field(
        default=120.0,
        gt=0.0,
        le=86400.0,
        description="Bound of every weight-sync wait; a generator past it is dropped, not waited for.",
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
        "one of them (Degraded while some are missing), so a restarting generator degrades it, never fails it.",
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
        "(ttlSecondsAfterFinished too): DeleteAfterOutput deletes them only once spec.output holds the final "
        "model (the job succeeded with an output), else keeps them; Retain always keeps them; Delete never does.",
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


class NatsSpec(SpecModel):
    url: str | None = Field(
        default=None,
        max_length=1024,
        pattern=NATS_URL,
        description="nats:// or tls:// URL(s), comma-separated; unset: embedded server (local) or the chart's.",
    )
    max_payload_mb: int = Field(default=8, ge=1, le=64, description="Largest NATS message (a micro-batch) in MiB.")


class StorageSpec(SpecModel):
    """The run directory (checkpoints, logs) of each trainer pod on Kubernetes: a PersistentVolumeClaim
    per trainer pod that survives suspend/resume; deleted with the job per runPolicy.checkpointRetention."""

    size: PositiveQuantity = Field(default="20Gi", description="Each trainer pod's checkpoint volume.")
    storage_class_name: DnsSubdomain | None = Field(default=None, description="Unset: the cluster default.")


class WandbSpec(SpecModel):
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(default=None, max_length=128, description="W&B entity (team or user).")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: files in the run directory, for `wandb sync` later (online needs WANDB_API_KEY).",
    )
    tags: list[str] = Field(default_factory=list, max_length=64, description="W&B run tags.")


class MlflowSpec(SpecModel):
    tracking_uri: str | None = Field(
        default=None, max_length=1024, description="Unset: a SQLite store in the run directory (mlflow.db)."
    )
    experiment: str | None = Field(default=None, max_length=256, description="Unset: the job's name.")


class TensorboardSpec(SpecModel):
    log_dir: str | None = Field(default=None, max_length=1024, description="Unset: tensorboard/ in the run directory.")


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
        description="The folder inside the claim; unset: the job's name.",
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


class JobSpec(SpecModel):
    mode: Literal["pipeline", "sync"] = Field(
        default="pipeline",
        description="pipeline: in-flight weight updates, lag <= rl.maxLag; sync: the conventional baseline "
        "(rl.stepsPerGeneration steps per generation phase).",
    )
    suspend: bool = Field(default=False, description="Checkpoint and scale every role to zero; false resumes.")
    model: ModelSpec = Field(default_factory=ModelSpec)
    task: TaskSpec = Field(default_factory=TaskSpec)
    rl: RLSpec = Field(default_factory=RLSpec)
    generator: GeneratorSpec = Field(default_factory=GeneratorSpec)
    preprocessor: PreprocessorSpec = Field(default_factory=PreprocessorSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    nats: NatsSpec = Field(default_factory=NatsSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    output: OutputSpec | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> JobSpec:
        if self.mode == "sync" and self.rl.max_lag not in (None, 0):
            raise ValueError(
                "rl.maxLag must be 0 or unset in sync mode (its lag is set by rl.stepsPerGeneration: at most k - 1)"
            )
        k = self.rl.steps_per_generation
        if k > 1 and self.mode != "sync":
            raise ValueError(
                f"rl.stepsPerGeneration ({k}) applies to sync mode (the conventional baseline): pipeline mode "
                f"sends weights after every step"
            )
        if k > 1 and self.eval.interval % k:
            raise ValueError(
                f"eval.interval ({self.eval.interval}) must be a multiple of rl.stepsPerGeneration ({k}): the "
                f"generators hold only the weights sent at the end of each phase"
            )
        if self.rl.importance_weights == "sequence" and self.rl.loss not in ("reinforce", "cispo"):
            raise ValueError(
                f"rl.importanceWeights: sequence applies to the reinforce and cispo losses, not "
                f"{self.rl.loss} (ppo clips per token, gspo is sequence-level already)"
            )
        if self.trainer.samples_per_step % self.rl.attempts:
            raise ValueError(
                f"trainer.samplesPerStep ({self.trainer.samples_per_step}) must be a multiple of "
                f"rl.attempts ({self.rl.attempts}) so that every step holds whole prompt groups"
            )
        if self.generator.sampling.max_tokens >= self.model.max_seq_len:
            raise ValueError("generator.sampling.maxTokens must be smaller than model.maxSeqLen")
        if self.weight_sync.backend == "nccl" and not (self.trainer.gpus and self.generator.gpus):
            raise ValueError(
                "weightSync.backend: nccl needs GPUs on both sides (trainer.gpus and generator.gpus); "
                "use gloo or auto on CPU"
            )
        if self.trainer.micro_batch_tokens < self.model.max_seq_len:
            raise ValueError("trainer.microBatchTokens must be at least model.maxSeqLen (one sample must fit)")
        if (self.trainer.gpus or self.generator.gpus) and self.model.path.startswith("builtin:"):
            raise ValueError(
                f"model.path: a GPU job needs a Hugging Face model ({self.model.path} is the CPU example's toy model)"
            )
        return self

    @property
    def max_lag(self) -> int:
        """The lag budget in force: explicit, else 4 in pipeline mode; in sync mode the phase's
        last step trains on data k - 1 versions old (k = stepsPerGeneration)."""
        if self.is_sync:
            return self.steps_per_generation - 1
        return 4 if self.rl.max_lag is None else self.rl.max_lag

    @property
    def is_sync(self) -> bool:
        """The conventional baseline: generate a phase of k steps whole, stop, take k steps, update, repeat."""
        return self.mode == "sync"

    @property
    def steps_per_generation(self) -> int:
        """k: optimizer steps per generation phase (the weights go out once per phase); 1 in pipeline mode."""
        return self.rl.steps_per_generation if self.is_sync else 1

    @property
    def streams_steps(self) -> bool:
        """A step reaches the trainer in waves as it is generated. Pipeline mode only, and not with
        tokenWeighting: token, whose loss weights are known only once the step is complete."""
        return not self.is_sync and self.rl.token_weighting == "sample"

    @property
    def waits_for_weights(self) -> bool:
        """Sync mode, or maxLag 0: the next phase is generated with the weights sent at the end of
        this one, so the trainer waits until every generator has loaded them."""
        return self.is_sync or self.max_lag == 0

    @property
    def pending_steps(self) -> int:
        """Steps the preprocessor may publish ahead of the trainer's version: maxPendingSteps, and
        at least a whole generation phase (sync mode publishes a phase at once)."""
        return max(self.preprocessor.max_pending_steps, self.steps_per_generation)

    @property
    def weight_transport(self) -> str:
        """The weight group's backend: `auto` is NCCL where trainers and generators have GPUs."""
        backend = self.weight_sync.backend
        if backend == "auto":
            return "nccl" if self.trainer.gpus and self.generator.gpus else "gloo"
        return backend

    @property
    def weights_dtype(self) -> str:
        """The weights' dtype in force: `model.dtype`, where `auto` is bfloat16 for a job with
        GPUs (half the memory and transfer of float32, and what the GPU kernels are fast in) and
        float32 on CPU."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return "bfloat16" if self.trainer.gpus or self.generator.gpus else "float32"

    @property
    def groups_per_step(self) -> int:
        return self.trainer.samples_per_step // self.rl.attempts

    @property
    def trainer_ranks_per_pod(self) -> int:
        """One DeepSpeed rank per GPU of a trainer pod (one per pod on CPU)."""
        return max(1, self.trainer.gpus)

    @property
    def generator_engines_per_pod(self) -> int:
        """One vLLM engine per tensorParallel GPUs of a generator pod (one per pod on CPU): a pod
        with more GPUs than tensorParallel runs several, each a generator of its own."""
        return max(1, self.generator.gpus // self.generator.tensor_parallel)

    @property
    def generator_engines(self) -> int:
        """Generators in all: pods × engines per pod (their ranks: pod index × per pod + engine)."""
        return self.generator.replicas * self.generator_engines_per_pod

    @property
    def trainer_ranks(self) -> int:
        return self.trainer.replicas * self.trainer_ranks_per_pod


class ObjectMeta(BaseModel):
    # Objects read back from the API server carry uid, resourceVersion, ...: keep what we use.
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _dns_name(cls, v: str) -> str:
        if len(v) > MAX_JOB_NAME or not DNS_LABEL.match(v):
            raise ValueError(
                f"must be a DNS-1035 label (a lowercase letter, then lowercase letters, digits or '-', not "
                f"ending in '-') of at most {MAX_JOB_NAME} characters, so that every child object's name fits"
            )
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and (len(v) > 63 or not re.fullmatch(DNS_1123_LABEL, v)):
            raise ValueError(
                "must be a namespace name (a DNS-1123 label: lowercase letters, digits or '-', at most 63 characters)"
            )
        return v


class PipelineRLJob(SpecModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", strict=True)
    api_version: Literal["pipelinerl.dev/v1alpha1"] = Field(default="pipelinerl.dev/v1alpha1", alias="apiVersion")
    kind: Literal["PipelineRLJob"] = "PipelineRLJob"
    metadata: ObjectMeta
    spec: JobSpec = Field(default_factory=JobSpec)
    status: dict[str, Any] | None = Field(default=None, exclude=True)

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        """On a cluster, the job's; locally `default` unless the manifest names one."""
        return self.metadata.namespace or "default"

    @property
    def subjects(self) -> JobSubjects:
        return JobSubjects(self.name, self.namespace)


Parsed = TypeVar("Parsed", bound=BaseModel)


class SpecError(ValueError):
    """A manifest that does not validate; the message names every field at fault."""


def format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_mapping(model: type[Parsed], data: Any, source: str, what: str, error: type[ValueError]) -> Parsed:
    """`data` validated as `model`; else `error`, naming every field at fault."""
    if not isinstance(data, dict):
        raise error(f"{source}: expected a {what} mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as err:
        raise error(f"{source} is not a valid {what}:\n{format_errors(err)}") from None


def parse_job(data: Any, source: str = "manifest") -> PipelineRLJob:
    return parse_mapping(PipelineRLJob, data, source, KIND, SpecError)


class _StrictLoader(yaml.SafeLoader):
    """Reads YAML as kubectl sends it to the API server: refuses a key given twice in one mapping
    (PyYAML keeps the last; kubectl refuses it), and reads `1e-6` as a number (YAML 1.2, as
    kubectl does; PyYAML's YAML 1.1 wants a dot, `1.0e-6`, and would read a string)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the first value would be silently lost)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """Writes what _StrictLoader reads back the same (a string like "1e5" quoted)."""


for _cls in (_StrictLoader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )


def load_yaml(text: str) -> Any:
    """A YAML value read as kubectl reads it (`1e-6` a number)."""
    return yaml.load(text, Loader=_StrictLoader)


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def read_manifest(path: str | Path) -> Any:
    """The one YAML document in `path`, read strictly; SpecError otherwise."""
    path = Path(path)
    try:
        documents = [d for d in yaml.load_all(path.read_text(), Loader=_StrictLoader) if d is not None]
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"{path}: cannot read manifest: {err}") from None
    if len(documents) > 1:
        raise SpecError(f"{path}: expected one document (one {KIND}), found {len(documents)}")
    return documents[0] if documents else None


def load_job(path: str | Path) -> PipelineRLJob:
    return parse_job(read_manifest(path), str(path))


def immutable_changes(old: PipelineRLJob, new: PipelineRLJob) -> list[str]:
    """The IMMUTABLE fields (camelCase paths) that differ between a stored job and its update."""

    def at(job: PipelineRLJob, path: str) -> Any:
        node: Any = job.spec.model_dump(mode="json", by_alias=True)
        for part in path.split("."):
            node = node[part]
        return node

    return [path for path in IMMUTABLE if at(old, path) != at(new, path)]


def dump_job(job: PipelineRLJob) -> str:
    return dump_yaml(job.model_dump(mode="json", by_alias=True, exclude_none=True))
