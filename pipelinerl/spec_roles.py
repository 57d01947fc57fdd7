"""The job's roles in the `PipelineRLJob` spec: the pod fields every role shares (image,
resources, GPUs, env, a pod-template passthrough) and what each adds: the generators' engines
and sampling, the preprocessor's backpressure, the trainers' optimisation and checkpoints."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelinerl.engine_args import engine_arg_errors
from pipelinerl.k8s_types import (
    RESOURCE_NAME,
    DnsSubdomain,
    ImageRef,
    Quantity,
    parse_quantity,
)
from pipelinerl.spec_base import (
    GPU_RESOURCE,
    MAX_SEED,
    MAX_STEPS,
    RESERVED_ENV,
    SpecModel,
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
                if not re.fullmatch(RESOURCE_NAME, name):
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
                    if isinstance(var, dict) and isinstance(var.get("name"), str) and var["name"] in RESERVED_ENV:
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

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_a_bool(cls, value: Any) -> Any:
        # A literal matches by equality: true would be stage 1 here, and the CRD (an integer) refuses it.
        if isinstance(value, bool):
            raise ValueError("a ZeRO stage is 0, 1, 2 or 3, not a boolean")
        return value

    @model_validator(mode="after")
    def _warmup_within_run(self) -> TrainerSpec:
        if self.warmup_steps > self.max_steps:
            raise ValueError(
                f"trainer.warmupSteps ({self.warmup_steps}) must not exceed trainer.maxSteps ({self.max_steps})"
            )
        return self
