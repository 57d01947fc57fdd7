"""The `PipelineRLJob` resource: the single source of truth for one RL run.

The same models validate a manifest for `pipelinerl run` / `pipelinerl validate`, drive the
local supervisor and the services, and generate the CRD schema (`pipelinerl crd`). Field names
are camelCase in YAML (Kubernetes convention) and snake_case in Python. The job (`JobSpec`) is
assembled here from its roles (`spec_roles`) and its other sections (`spec_sections`), on what
they share (`spec_base`); every name is importable from here.
"""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from pipelinerl.contracts import BATCH_BYTES_PER_TOKEN, BOOKS_BYTES, ROLLOUT_BYTES_PER_TOKEN, JobSubjects
from pipelinerl.k8s_types import DNS_1123_LABEL, DNS_SUBDOMAIN
from pipelinerl.spec_base import (
    API_GROUP,
    API_VERSION,
    DNS_LABEL,
    GPU_RESOURCE,
    IMMUTABLE,
    KIND,
    MAX_JOB_NAME,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    RESERVED_ENV,
    TASK_IMPORT_PATH,
    TASK_NAMES,
    NullsPruned,
    SpecModel,
    closest,
)
from pipelinerl.spec_roles import (
    TOP_P_ERROR,
    EnvSource,
    EnvVar,
    GeneratorSpec,
    KeyRef,
    PreprocessorSpec,
    Resources,
    RoleSpec,
    SamplingSpec,
    TrainerSpec,
)
from pipelinerl.spec_sections import (
    OUTPUT_FOLDERS,
    EvalSpec,
    MlflowSpec,
    ModelSpec,
    NatsSpec,
    NetworkSpec,
    OutputSpec,
    RLSpec,
    RunPolicy,
    SchedulingSpec,
    StorageSpec,
    TaskSpec,
    TensorboardSpec,
    TrackingSpec,
    WandbSpec,
    WeightSyncSpec,
)

__all__ = [  # the spec's names, wherever they are defined
    "API_GROUP", "API_VERSION", "DNS_LABEL", "GPU_RESOURCE", "IMMUTABLE", "KIND", "MAX_JOB_NAME", "MAX_SECONDS",
    "MAX_SEED", "MAX_STEPS", "RESERVED_ENV", "TASK_IMPORT_PATH", "TASK_NAMES", "TOP_P_ERROR", "EnvSource", "EnvVar",
    "EvalSpec", "GeneratorSpec", "JobSpec", "KeyRef", "MlflowSpec", "ModelSpec", "NatsSpec", "NetworkSpec",
    "ObjectMeta", "OutputSpec", "PipelineRLJob", "PreprocessorSpec", "RLSpec", "Resources", "RoleSpec", "RunPolicy",
    "SamplingSpec", "SchedulingSpec", "SpecError", "SpecModel", "StorageSpec", "TaskSpec", "TensorboardSpec",
    "TrackingSpec", "TrainerSpec", "WandbSpec", "WeightSyncSpec", "dump_job", "dump_yaml", "format_errors",
    "immutable_changes", "load_job", "load_yaml", "parse_job", "parse_mapping", "read_manifest", "spec_value",
]  # fmt: skip


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
        if problems := _message_problems(self):
            raise ValueError(problems[0])
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


# A label's name, or its value where it is not empty (apimachinery's qualified name)
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"


def _dns_subdomain(text: str) -> bool:
    return len(text) <= 253 and re.fullmatch(DNS_SUBDOMAIN, text) is not None


OBJECT_META_FIELDS = frozenset(
    "name generateName namespace selfLink uid resourceVersion generation creationTimestamp deletionTimestamp "
    "deletionGracePeriodSeconds labels annotations ownerReferences finalizers managedFields".split()
)  # metav1.ObjectMeta's


class ObjectMeta(NullsPruned):
    # Objects read back from the API server carry uid, resourceVersion, ...: keep what we use.
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        # kubectl's strict field validation (its default) refuses a field ObjectMeta does not have.
        if isinstance(data, dict):
            for key in data:
                if key not in OBJECT_META_FIELDS:
                    close = closest(str(key), sorted(OBJECT_META_FIELDS))
                    raise ValueError(f"{key}: unknown field" + (f" (did you mean {close}?)" if close else ""))
        return data

    @model_validator(mode="before")
    @classmethod
    def _generated_name(cls, data: Any) -> Any:
        # `generateName` alone (kubectl create): the API server appends 5 random characters
        # before any check sees the job; so do we.
        if isinstance(data, dict) and not data.get("name") and isinstance(data.get("generateName"), str):
            suffix = "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
            return {**data, "name": data["generateName"] + suffix}
        return data

    @field_validator("name")
    @classmethod
    def _dns_name(cls, v: str) -> str:
        if len(v) > MAX_JOB_NAME or not DNS_LABEL.fullmatch(v):
            raise ValueError(
                f"must be a DNS-1035 label (a lowercase letter, then lowercase letters, digits or '-', not "
                f"ending in '-') of at most {MAX_JOB_NAME} characters, so that every child object's name fits "
                f"(a generateName at most {MAX_JOB_NAME - 5}: the API server adds 5)"
            )
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        # The API server's own check of every object's labels (the job's, and so its children's)
        for key, value in v.items():
            prefix, _, name = key.rpartition("/")
            bad_prefix = "/" in key and not _dns_subdomain(prefix)
            if len(name) > 63 or not re.fullmatch(LABEL_NAME, name) or bad_prefix:
                raise ValueError(f"{key!r} is not a label key ([prefix/]name: name ≤ 63 of [A-Za-z0-9-_.])")
            if len(value) > 63 or not re.fullmatch(f"({LABEL_NAME})?", value):
                raise ValueError(f"{key}: {value!r} is not a label value (≤ 63 of [A-Za-z0-9-_.], alphanumeric ends)")
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

    @model_validator(mode="after")
    def _not_an_output_folder(self) -> PipelineRLJob:
        output = self.spec.output
        if output is not None and output.claim_name and self.metadata.name in OUTPUT_FOLDERS:
            raise ValueError(
                f"metadata.name: a job with spec.output.claimName is not named {' or '.join(OUTPUT_FOLDERS)} "
                f"(its folder, <subPath>/<name>, would be another job's)"
            )
        return self

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


def format_errors(err: ValidationError, model: type[BaseModel] | None = None) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(model, e["loc"])
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def _did_you_mean(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    """The field of the model at `loc[:-1]` closest to the unknown `loc[-1]`, where one is close."""
    import typing

    node: Any = model
    for part in loc[:-1]:
        field = next((f for n, f in node.model_fields.items() if part in (n, f.alias)), None) if node else None
        inner: list[Any] = [*typing.get_args(field.annotation), field.annotation] if field else []
        node = next((a for a in inner if isinstance(a, type) and issubclass(a, BaseModel)), None)
    close = closest(str(loc[-1]), [f.alias or n for n, f in node.model_fields.items()]) if node else None
    return f" (did you mean {close}?)" if close else ""


def parse_mapping(model: type[Parsed], data: Any, source: str, what: str, error: type[ValueError]) -> Parsed:
    """`data` validated as `model`; else `error`, naming every field at fault."""
    if not isinstance(data, dict):
        raise error(f"{source}: expected a {what} mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as err:
        raise error(f"{source} is not a valid {what}:\n{format_errors(err, model)}") from None


MAX_DEPTH = 32  # a pod spec is at most ~12 levels deep; checking a deeper one costs every door


def too_deep(data: Any, limit: int = MAX_DEPTH) -> str | None:
    """The path where `data` nests deeper than `limit` (looked at without recursion, so that no
    manifest can exhaust the stack of the doors that read it); None where it does not."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > limit:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        stack.extend((v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in items)
    return None


def check_depth(data: Any, source: str) -> None:
    deep = too_deep(data)
    if deep is not None:
        raise SpecError(f"{source} is not a valid {KIND}:\n  {deep[:200]}: nested more than {MAX_DEPTH} levels deep")


def parse_job(data: Any, source: str = "manifest") -> PipelineRLJob:
    check_depth(data, source)
    return parse_mapping(PipelineRLJob, data, source, KIND, SpecError)


_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")  # go-yaml v2's yamlStyleFloat
_GO_BASES = {"x": (16, "0123456789abcdefABCDEF"), "o": (8, "01234567"), "b": (2, "01")}


def _go_int(body: str) -> int | None:
    """Go's strconv.ParseInt(body, 0) without its sign: `0x`/`0o`/`0b` (either case) and a
    leading-zero octal, else decimal; None where Go reads no integer."""
    prefix = body[1:2].lower() if body.startswith("0") else ""
    if prefix in _GO_BASES:
        (base, allowed), digits = _GO_BASES[prefix], body[2:]
    elif body.startswith("0") and len(body) > 1:
        (base, allowed), digits = _GO_BASES["o"], body[1:]
    else:
        base, allowed, digits = 10, "0123456789", body
    return int(digits, base) if digits and set(digits) <= set(allowed) else None


def go_number(text: str) -> int | float | str:
    """A plain scalar that starts like a number, as go-yaml v2 resolves it and Go's JSON then
    writes it: underscores dropped; an integer (ParseInt, base 0) within int64 or uint64; else a
    float where it looks like one (`09` is 9.0, written 9; a whole float below 1e21 is written
    without a fraction, as an integer field takes it); else (or out of float64's range) the text."""
    plain = text.replace("_", "")
    sign, body = (plain[0], plain[1:]) if plain[:1] in "+-" else ("", plain)
    value = _go_int(body)
    if value is not None and -(2**63) <= (value := -value if sign == "-" else value) < 2**64:
        return value
    if not _GO_FLOAT.fullmatch(plain):
        return text
    number = float(plain)
    if math.isinf(number):
        return text
    return int(number) if number.is_integer() and abs(number) < 1e21 else number


# go-yaml v2's boolean words, in the cases it reads (its resolve table).
GO_BOOLS = {
    word: value
    for words, value in (("y yes true on", True), ("n no false off", False))
    for lower in words.split()
    for word in (lower, lower.capitalize(), lower.upper())
}


class _StrictLoader(yaml.SafeLoader):
    """Reads YAML as kubectl sends it to the API server (go-yaml v2, then JSON): refuses a key
    given twice in one mapping (PyYAML keeps the last; kubectl refuses it); reads numbers as Go
    does (`go_number`: `1e-6`, `+.5`, `0o17`, `09` are numbers, which PyYAML's YAML 1.1 reads as
    strings; `2.0` arrives as 2), y/Y/n/N as booleans, and mapping keys as JSON's strings (`y:`
    is "true", `1:` is "1"); merges (`<<`) as go-yaml does, in document order; keeps `2025-01-15`,
    `1:30` (PyYAML: a date, base 60 90), `=` and a value under an unknown tag as strings; and
    refuses infinity and NaN, which JSON cannot hold (kubectl fails on them)."""

    def construct_yaml_float(self, node: yaml.ScalarNode) -> int | float | str:
        text = str(node.value)
        if ":" in text:  # base 60 in YAML 1.1 only
            return text
        if text.lstrip("+-").lower() in (".inf", ".nan"):
            raise yaml.constructor.ConstructorError(
                None, None, f"{text}: JSON (what kubectl sends) has no infinity or NaN", node.start_mark
            )
        return go_number(text)

    construct_yaml_int = construct_yaml_float  # type: ignore[assignment]

    def construct_yaml_bool(self, node: yaml.ScalarNode) -> bool:
        """go-yaml v2's booleans; anything else under `!!bool` (`!!bool 1`) refused, as go-yaml does."""
        text = str(node.value)
        if text not in GO_BOOLS:
            raise yaml.constructor.ConstructorError(
                None, None, f"{text!r} is not a boolean (true/false, yes/no, on/off, y/n)", node.start_mark
            )
        return GO_BOOLS[text]

    def construct_yaml_timestamp(self, node: yaml.ScalarNode, values: Any = None) -> str:  # type: ignore[override]
        return str(node.value)

    def construct_as_string(self, node: yaml.ScalarNode) -> str:
        return str(node.value)

    def construct_untagged(self, suffix: str, node: yaml.Node) -> Any:
        """A node under a tag go-yaml does not know (`!foo`): read as if untagged (a scalar: its text)."""
        if isinstance(node, yaml.MappingNode):
            return self.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return self.construct_sequence(node, deep=True)
        return str(node.value)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:  # type: ignore[override]
        out: dict[Any, Any] = {}
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # go-yaml v2: merged here, later keys overwriting
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in reversed(merged):  # of a list of maps, the first wins
                    if not isinstance(source, yaml.MappingNode):
                        raise yaml.constructor.ConstructorError(
                            None, None, "a merge (<<) takes a mapping or a list of mappings", source.start_mark
                        )
                    out.update(self.construct_mapping(source, deep=True))
                continue
            key = _json_key(self.construct_object(key_node, deep=True))
            try:
                given_twice = key in seen
            except TypeError:  # a list or a mapping as a key
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a scalar (kubectl refuses it)", key_node.start_mark
                ) from None
            if given_twice:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (the first value would be silently lost)", key_node.start_mark
                )
            seen.add(key)
            out[key] = self.construct_object(value_node, deep=deep)
        return out


def _json_key(key: Any) -> Any:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key) if isinstance(key, int) else key


class _Dumper(yaml.SafeDumper):
    """Writes what _StrictLoader reads back the same (a string like "1e5" quoted)."""


for _tag, _construct in (
    ("float", _StrictLoader.construct_yaml_float),
    ("int", _StrictLoader.construct_yaml_int),
    ("bool", _StrictLoader.construct_yaml_bool),
    ("timestamp", _StrictLoader.construct_yaml_timestamp),
    ("value", _StrictLoader.construct_as_string),
):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _construct)
_StrictLoader.add_multi_constructor("!", _StrictLoader.construct_untagged)
for _cls in (_StrictLoader, _Dumper):  # after PyYAML's own resolvers: tried when none of them matched
    # anything that starts like a number is one for go-yaml to try (`go_number`: the text otherwise)
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9._][0-9a-zA-Z_.+-]*$"), list("-+.0123456789")
    )
    _cls.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^[yYnN]$"), list("yYnN"))


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
    except RecursionError:
        raise SpecError(f"{path}: cannot read manifest: nested more than {MAX_DEPTH} levels deep") from None
    if len(documents) > 1:
        raise SpecError(f"{path}: expected one document (one {KIND}), found {len(documents)}")
    return documents[0] if documents else None


def load_job(path: str | Path) -> PipelineRLJob:
    return parse_job(read_manifest(path), str(path))


def spec_value(job: PipelineRLJob, path: str) -> Any:
    """The spec's value at a dotted camelCase path (`trainer.replicas`), as JSON has it."""
    node: Any = job.spec.model_dump(mode="json", by_alias=True)
    for part in path.split("."):
        node = node[part]
    return node


def immutable_changes(old: PipelineRLJob, new: PipelineRLJob) -> list[str]:
    """The IMMUTABLE fields (camelCase paths) that differ between a stored job and its update."""
    return [path for path in IMMUTABLE if spec_value(old, path) != spec_value(new, path)]


def dump_job(job: PipelineRLJob) -> str:
    return dump_yaml(job.model_dump(mode="json", by_alias=True, exclude_none=True))


def _message_problems(spec: JobSpec) -> list[str]:
    """The messages a job would publish that NATS would refuse (`nats.maxPayloadMb`): a rollout
    group (every attempt at its longest) and a micro-batch (full, with its books). Published, one
    would fail on every retry, and the service that made it would restart into it again."""
    payload = spec.nats.max_payload_mb << 20
    group = spec.rl.attempts * spec.model.max_seq_len * ROLLOUT_BYTES_PER_TOKEN
    batch = spec.trainer.micro_batch_tokens * BATCH_BYTES_PER_TOKEN + BOOKS_BYTES
    problems = []
    if group > payload:
        problems.append(
            f"nats.maxPayloadMb ({spec.nats.max_payload_mb}) is too small for a rollout group: rl.attempts "
            f"({spec.rl.attempts}) x model.maxSeqLen ({spec.model.max_seq_len}) tokens at up to "
            f"{ROLLOUT_BYTES_PER_TOKEN} bytes each take {group / 2**20:.1f} MiB"
        )
    if batch > payload:
        problems.append(
            f"nats.maxPayloadMb ({spec.nats.max_payload_mb}) is too small for a micro-batch: "
            f"trainer.microBatchTokens ({spec.trainer.micro_batch_tokens}) at up to {BATCH_BYTES_PER_TOKEN} bytes "
            f"each, and the step's books, take {batch / 2**20:.1f} MiB"
        )
    return problems
