"""The inference engine: vLLM AsyncLLM in-process, as a task `Policy`, with in-flight
weight updates.

Per-token policy versions come from vLLM itself: the engine core stamps each step's outputs
with its current weight-version label and reports, on the final output, spans of output
tokens per label. We set the label while generation is paused, right after the new weights are
loaded, so every token is tagged with the weights that actually sampled it (no race with
outputs still in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipelinerl.awake import wait_awake
from pipelinerl.spec import PipelineRLJob, SpecError
from pipelinerl.tasks import Completion, PromptTooLong
from pipelinerl.weight_group import WeightSyncError, form_bound

if TYPE_CHECKING:  # vLLM is imported where it runs: importing it costs seconds
    from vllm.inputs import TokensPrompt

log = logging.getLogger(__name__)
EXTENSION = "pipelinerl_generator.weight_receiver.WeightReceiverExtension"
POLL_S = 0.005  # how often the engine asks its workers whether work beside generation is done
JOIN_MARGIN_S = 30.0  # past the trainer's bound on forming an epoch: the store's round trips, a loaded machine


class WeightsKept(RuntimeError):
    """A staged update failed before the swap: the live weights are untouched."""


class EngineStuck(RuntimeError):
    """The engine's core did not answer a call in time: it is blocked (a hung collective, a
    stalled device), and so is its generation; or its workers can take no weights any more. Not
    recoverable in this process: the generator stops, and its pod is restarted."""


class WorkersOutOfStep(EngineStuck):
    """A worker call raised in an engine of several workers (tensor parallelism): vLLM's
    multiprocess executor raises at the first worker that failed and leaves the others' answers
    queued, to be read as the answers of the calls that follow. Every call the generator makes
    routinely answers its failures instead (`weight_receiver`); one that raises all the same stops
    the generator, which is restarted."""


def rpc_timeout_s(weight_sync_timeout_s: float) -> float:
    """The bound of each call into the engine core: past every weight-sync wait its workers
    make themselves (a group's rendezvous, a transfer, each bounded by weightSync.timeoutSeconds),
    so that only a blocked core reaches it."""
    return 2 * weight_sync_timeout_s + 30.0


@dataclass
class UpdateStats:
    version: int
    pause_seconds: float  # generation stopped
    running_requests: int  # requests kept running across the update
    seconds: float = 0.0  # the whole update, transfer included
    staged: bool = False  # transferred and loaded beside generation (else inside the pause)


def engine_args(job: PipelineRLJob, model_path: str, seed: int, utilization: float | None = None):
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec = job.spec
    generator = spec.generator
    args: dict[str, Any] = dict(
        model=model_path,
        dtype=spec.weights_dtype,
        max_model_len=spec.model.max_seq_len,
        seed=seed,
        worker_extension_cls=EXTENSION,
        tensor_parallel_size=generator.tensor_parallel,
        enforce_eager=generator.gpus == 0,  # compiling costs 30-70 s on CPU and buys little for small models
        enable_prefix_caching=True,
        disable_log_stats=True,
        # The behaviour policy's log-probs, as the trainer computes its own: after the temperature
        # (and top-p/top-k, which the spec keeps off). vLLM's default, raw_logprobs, is before
        # them: at temperature != 1 every on-policy importance ratio would differ from 1.
        logprobs_mode="processed_logprobs",
    )
    if utilization is not None:  # the generator's memory plan: room beside vLLM for weight updates
        args["gpu_memory_utilization"] = utilization
    extra = dict(generator.engine_args)
    # The LM head in fp32, as the trainer's (`logprob_head`): logits kept in fp32 from the 16-bit
    # operands, not rounded to bf16 first, for train/inference parity. vLLM computes the head
    # after the graphed forward, in its sampler's memory profile; on CUDA one GEMM writes fp32.
    args["hf_overrides"] = (extra.pop("hf_overrides", None) or {}) | {"head_dtype": "float32"}
    args.update(extra)
    return AsyncEngineArgs(**args)


def quantized_ahead(hf_config: dict[str, Any]) -> str | None:
    """Why the engine cannot take the trainer's weights into this checkpoint: one quantized ahead
    (a `quantization_config`: FP8, AWQ, GPTQ, compressed-tensors) holds packed weights and scales
    the trainer's 16-bit broadcast has no counterpart for, and vLLM's reload would cast the
    weights into the packed storage with the scales unset, silently. vLLM's online quantization
    of a 16-bit checkpoint (`quantization: fp8`) is re-run at each reload."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method", "quantized") if isinstance(config, dict) else "quantized"
    return (
        f"spec.model.path: a checkpoint quantized ahead ({method}) cannot take the trainer's 16-bit "
        "weights: train from its 16-bit original (vLLM may quantize that online: generator.engineArgs.quantization)"
    )


def planned_utilization(job: PipelineRLJob, hf_config: dict[str, Any]) -> float | None:
    """The generator's memory plan (`pipelinerl.generator_memory`) with the model's own config
    and this GPU's real size: SpecError, by field, where weight updates cannot fit beside vLLM;
    else the utilization to give vLLM (None: the job set it, or the plan cannot be made)."""
    from vllm.platforms import current_platform

    from pipelinerl.generator_memory import job_plan

    memory, why = job_plan(job.spec, config=hf_config, gpu_bytes=current_platform.get_device_total_memory(0))
    if memory is None:
        log.warning("generator GPU memory not planned: %s", why)
        return None
    for line in memory.lines():
        log.info("%s", line)
    if memory.errors:
        raise SpecError("; ".join(f"spec.{e}" for e in memory.errors))
    return None if memory.explicit_utilization else memory.utilization


def configure_cpu_env() -> None:
    """Defaults for the CPU build. VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps LLMEngine's core in
    process; AsyncLLM runs its engine core in a process of its own whatever it says."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def threads_running() -> int:
    """This process's threads, as the kernel counts them (OpenMP's and native libraries' too)."""
    return len(os.listdir("/proc/self/task"))


def core_start_method(executor: str, threads: int) -> str:
    """How AsyncLLM starts its engine core process. vLLM's CPU platform sets spawn, so the core
    imports vLLM again (~17 CPU-seconds of every generator start). Forked, it starts from this
    process's imports: safe while no thread of ours runs (none can hold a lock the child would
    inherit taken) and no OpenMP pool exists (it breaks in a forked child). vLLM's own zmq
    threads start after this check, and the child never uses that context. An executor other
    than "uni" (tensor parallelism, or VLLM_ENABLE_V1_MULTIPROCESSING=1) starts workers from the
    core, which by then runs threads: spawn. The same holds on GPUs, where vLLM itself would fork
    unless CUDA is already initialised: a GPU generator builds its engine with its health server
    and NATS client running, so its core is spawned."""
    return "fork" if executor == "uni" and threads == 1 else "spawn"


def _forget_parent_signals() -> None:
    """In a forked child: the parent's event loop registered a wakeup fd for its signals, and a
    signal the child catches (vLLM's core handles SIGTERM when it is shut down) would be written
    into the parent's loop, which would take it for its own SIGTERM and stop the generator."""
    signal.set_wakeup_fd(-1)


@functools.cache
def forget_parent_signals_after_fork() -> None:
    os.register_at_fork(after_in_child=_forget_parent_signals)


def register_model_here(model_path: str) -> None:
    """vLLM inspects a model class it has not imported in a subprocess that imports vLLM again
    (~8 CPU-seconds), unless VLLM_CACHE_ROOT holds the answer from an earlier start, which a new
    pod or machine does not. The subprocess keeps CUDA out of this process; the CPU build has
    none, so a local model folder's classes are imported and registered here instead."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return
    from vllm import ModelRegistry

    for arch in json.loads(config.read_text()).get("architectures") or []:
        entry = ModelRegistry.models.get(arch)
        if entry is not None:
            ModelRegistry.register_model(arch, entry.load_model_cls())


@contextlib.contextmanager
def compile_disabled(disable: bool):
    """Eager, vLLM still torch.compiles one sampler function (the sampled token's rank among the
    logprobs, `batched_count_greater_than`): ~12 CPU-seconds at a generator's first completion on
    a machine without inductor's cache, ~1.6 s with it. Uncompiled it is one comparison and a sum.
    Held while the engine core starts: a forked core keeps the setting, a spawned one reads the
    variable; this process (a test's, too) is left as it was."""
    if not disable:
        yield
        return
    import torch._dynamo

    before = os.environ.get("TORCH_COMPILE_DISABLE")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        if before is None:
            del os.environ["TORCH_COMPILE_DISABLE"]
        else:
            os.environ["TORCH_COMPILE_DISABLE"] = before


class Engine:
    """AsyncLLM plus what RL needs: sampling logprobs, token versions, weight updates."""

    def __init__(self, job: PipelineRLJob, model_path: str, seed: int = 0):
        from vllm.v1.engine.async_llm import AsyncLLM

        generator = job.spec.generator
        if generator.gpus == 0:
            configure_cpu_env()
            register_model_here(model_path)
        self.job = job
        self.sampling = generator.sampling
        args = engine_args(job, model_path, seed)
        config = args.create_engine_config()  # where the CPU platform sets spawn
        if refused := quantized_ahead(config.model_config.hf_config.to_dict()):
            raise SpecError(refused)
        if generator.gpus:
            utilization = planned_utilization(job, config.model_config.hf_config.to_dict())
            if utilization is not None:
                args = engine_args(job, model_path, seed, utilization)
                config = args.create_engine_config()
        executor = str(config.parallel_config.distributed_executor_backend)
        core_start = core_start_method(executor, threads_running())
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = core_start
        if core_start == "fork":
            forget_parent_signals_after_fork()
        log.info("engine core: %s", core_start)
        with compile_disabled(generator.gpus == 0 and config.model_config.enforce_eager):
            self.llm = AsyncLLM.from_vllm_config(
                config, enable_log_requests=args.enable_log_requests, disable_log_stats=args.disable_log_stats
            )
        self.eos = self.llm.tokenizer.eos_token_id if self.llm.tokenizer else None
        self.staged = job.spec.weight_sync.staged
        self.update_path: str | None = None  # staged, in_place or reload: `prepare_updates`
        self.version = -1  # the label of the weights held: -1 until `start` or an update sets it
        self.running = 0
        # Clear while an update's pause lasts: a request submitted then waits, so that it is
        # salted with the version it runs on (its prompt would otherwise hit older blocks).
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.tokens_generated = 0
        self.rpc_timeout_s = rpc_timeout_s(job.spec.weight_sync.timeout_seconds)

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`collective_rpc` on every worker, bounded (`_bounded`). vLLM passes its own `timeout`
        to the executor only: the multiprocess executor (tensor parallelism) honours it, the
        one-worker executor (a single GPU, the CPU build) runs the method on the engine core's
        thread and ignores it, so a call blocked there (an NCCL collective that never completes
        does not raise) would be awaited forever. With several workers, one that raised leaves
        the executor's answers out of step (WorkersOutOfStep)."""
        try:
            return await self._bounded(self.llm.collective_rpc(method, args=args), method)
        except EngineStuck:
            raise
        except Exception as err:
            if self.job.spec.generator.tensor_parallel > 1:
                raise WorkersOutOfStep(f"worker call {method} raised with several workers: {err}") from err
            raise

    async def _bounded(self, call, what: str):
        """A call into the engine core, given up on after `rpc_timeout_s` of the generator's awake
        time (vLLM drops the late answer of a call given up on): EngineStuck, naming it. Awake
        time: a pod paused longer than the bound, its core with it, goes on when thawed."""
        try:
            return await wait_awake(call, self.rpc_timeout_s)
        except TimeoutError:
            raise EngineStuck(
                f"the engine did not answer {what} within {self.rpc_timeout_s:.0f} s "
                "(2 x weightSync.timeoutSeconds + 30): its core is blocked"
            ) from None

    async def check_alive(self) -> None:
        """A round trip through the engine core's loop, which answers between its steps: a core
        stalled in a step (a hung kernel, a device that stopped answering) raises EngineStuck
        here even while no weight update calls into it. vLLM's multiprocess executor bounds a
        step itself (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS); the one-worker executor does not."""
        await self._bounded(self.llm.is_paused(), "a liveness check")

    async def start(self, version: int = 0) -> None:
        await self.set_version(version)

    async def set_version(self, version: int) -> None:
        await self._bounded(self.llm.update_weight_version(str(version)), "update_weight_version")
        self.version = version

    async def generate(self, prompt: list[int], max_tokens: int, greedy: bool = False) -> Completion:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=0.0 if greedy else self.sampling.temperature,
            top_p=1.0 if greedy else self.sampling.top_p,
            max_tokens=max_tokens,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            stop_token_ids=[self.eos] if self.eos is not None else None,
            detokenize=False,  # tasks decode the token ids themselves; vLLM's per-step detokenizing is wasted
        )
        if len(prompt) >= self.job.spec.model.max_seq_len:
            raise PromptTooLong(
                f"a prompt of {len(prompt)} tokens leaves no room for a generated one in model.maxSeqLen "
                f"({self.job.spec.model.max_seq_len})"
            )
        final = None
        await self.unpaused.wait()
        self.running += 1
        try:
            # update_weights keeps the KV cache (running requests continue), so the prefix cache
            # still holds blocks computed by older weights; salting with the version keeps a new
            # request from reusing them (it would otherwise sample from stale-weight KV). One
            # already queued in vLLM when an update lands keeps its salt, as a running one its KV.
            inputs: TokensPrompt = {"prompt_token_ids": prompt, "cache_salt": f"v{self.version}"}
            async for out in self.llm.generate(inputs, params, request_id=uuid.uuid4().hex):
                final = out
        finally:
            self.running -= 1
        assert final is not None, "vLLM ended a request without output"
        c = final.outputs[0]
        if c.finish_reason in ("abort", "error"):  # not a completion: scored as one, it would be trained
            raise RuntimeError(f"vLLM ended a request with finish reason {c.finish_reason!r}")
        tokens = list(c.token_ids)
        # logprobs=0 asked for the sampled token's at every position: vLLM's union type allows none
        logprobs = [lp[t].logprob for lp, t in zip(c.logprobs, tokens)]  # type: ignore[arg-type, index]
        self.tokens_generated += len(tokens)
        return Completion(
            tokens=tokens,
            logprobs=logprobs,
            versions=token_versions(c.weight_versions, len(tokens)),
            finish_reason="length" if c.finish_reason == "length" else "stop",
        )

    async def join_weight_group(
        self, host: str, port: int, group: str, rank: int, world_size: int, timeout_s: float, token: str = ""
    ) -> None:
        """Join a weight group's epoch beside generation: the workers wait for the epoch's other
        members, and connect where `works_beside`, on threads of their own (`init_weight_group`),
        while the engine steps on; each poll is a call the core answers between steps. Bounded
        past the trainer's own bound on forming the epoch (it is ended past that): NCCL setting a
        communicator up with a peer dead since it joined blocks past every timeout (EngineStuck)."""
        backend = self.job.spec.weight_transport
        args = (host, port, group, rank, world_size, timeout_s, backend, token, self.works_beside)
        # An update given up on still receiving into the staging copy, or no transport: stop.
        if cannot := told(await self._rpc("init_weight_group", *args)):
            raise EngineStuck(f"the engine's workers can take no weights: {cannot}")
        bound = form_bound(timeout_s) + JOIN_MARGIN_S
        try:
            await wait_awake(self._until_done("weight_group_joined"), bound)
        except TimeoutError:
            raise EngineStuck(f"the weight group join did not end within {bound:.0f} s") from None
        if failed := told(await self._rpc("accept_weight_group")):
            raise WeightSyncError(failed)

    async def prepare_updates(self) -> None:
        """Choose the loading path (`weight_receiver`) and allocate the staging copy, once: at
        the generator's start, so that a copy that does not fit fails the start, not an update."""
        if self.update_path is not None:
            return
        spec = self.job.spec
        infos = await self._rpc(
            "prepare_weight_updates", self.staged, spec.weight_sync.bucket_mb << 20, spec.weight_transport == "nccl"
        )
        if room := next((i["room"] for i in infos if i["room"]), ""):
            raise SpecError(f"spec.{room}")
        info = infos[0]
        self.update_path = info["path"]
        log.info(
            "weight updates: %s%s, staging copy %.1f MiB per worker%s",
            self.update_path,
            " (received inside the pause)" if self.update_path == "staged" and not self.stages_beside else "",
            info["staging_bytes"] / 2**20,
            f"; in-place loading would miss: {'; '.join(info['blockers'])}" if info["blockers"] else "",
        )

    async def choose_staged(self, staged: bool) -> None:
        """Take the staged path or the in-place one from the next update on (tests and benchmarks
        compare them on one engine; a job keeps `weightSync.staged`)."""
        if staged != self.staged or self.update_path is None:
            self.staged, self.update_path = staged, None
            await self.prepare_updates()

    @property
    def works_beside(self) -> bool:
        """Whether the weight group's collectives may run on a thread of each worker, beside
        generation: not over NCCL with tensor parallelism, where that thread's communicator would
        run beside the worker's own tensor-parallel all-reduces on the same GPU, which NCCL does
        not support (two communicators' kernels can deadlock)."""
        return not (self.job.spec.weight_transport == "nccl" and self.job.spec.generator.tensor_parallel > 1)

    @property
    def stages_beside(self) -> bool:
        """Staged updates are received beside generation where `works_beside`; otherwise inside
        the pause, on the worker's thread, still into the staging copy: the pause then lasts the
        transfer."""
        return self.update_path == "staged" and self.works_beside

    async def update_weights(self, version: int, buckets: list[dict]) -> UpdateStats:
        """With requests running: receive and load the new weights into the staging copy beside
        them, then pause keeping them and their KV cache, copy the weights in, relabel, resume.
        With none running (nothing to keep going), without a staging copy (`weightSync.staged:
        false`, or models vLLM post-processes: `weight_receiver`), or over NCCL with tensor
        parallelism (`stages_beside`): receive inside the pause."""
        await self.prepare_updates()
        t0 = time.perf_counter()
        staged = self.stages_beside and self.running > 0 and all(await self._rpc("stage_weights", buckets))
        if staged:
            try:
                await self._wait_staged(t0 + self.job.spec.weight_sync.timeout_seconds)
            except EngineStuck:
                raise
            except Exception as err:
                raise WeightsKept(
                    f"staged update to version {version} failed, generating on with version "
                    f"{self.version}: {type(err).__name__}: {err}"
                ) from err
        t_pause = time.perf_counter()
        running = self.running
        self.unpaused.clear()
        try:
            kept = await self._paused_update(version, buckets, staged)
        finally:
            self.unpaused.set()  # a stuck core stops the generator: its requests fail there
        if kept:
            raise WeightsKept(f"update to version {version} failed, generating on with version {self.version}: {kept}")
        t1 = time.perf_counter()
        return UpdateStats(
            version=version, pause_seconds=t1 - t_pause, running_requests=running, seconds=t1 - t0, staged=staged
        )

    async def _paused_update(self, version: int, buckets: list, staged: bool) -> str:
        """The update's pause: the staged weights committed, or the whole update received and
        loaded; the version set where it succeeded. Why the old weights were kept, or "". Anything
        raised leaves the engine paused: the weights may be half-loaded, or their shards of two
        versions, under the old label, and the generator stops; resumed, its running requests
        would sample tokens from them, which a group finishing before the stop would publish."""
        # The engine core's pause, not AsyncLLM.pause_generation: that adds a fixed 20 ms sleep
        # so aborted requests' last outputs arrive first, which "keep" mode does not need. It
        # returns once the batches in flight are done and the device is synchronized.
        await self._bounded(self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False), "pause")
        resume = True
        try:
            if staged:
                await self._rpc("commit_staged_weights")
                kept = ""
            else:
                kept = one_version(await self._rpc("receive_weights", buckets), version)
            if not kept:
                await self.set_version(version)
        except BaseException:
            resume = False
            raise
        finally:
            if resume:
                await self._bounded(self.llm.resume_generation(), "resume")
        return kept

    async def _wait_staged(self, deadline: float) -> None:
        try:
            await self._until_done("staged_weights_ready", deadline)
        except TimeoutError:
            raise TimeoutError(
                f"weights not received and loaded within weightSync.timeoutSeconds="
                f"{self.job.spec.weight_sync.timeout_seconds}"
            ) from None

    async def _until_done(self, method: str, deadline: float = float("inf")) -> None:
        """Poll a worker call about work running beside generation (each answers None while it
        runs, "" once done, else why it failed: raised here as WeightSyncError) until every worker
        is done; TimeoutError past `deadline` (perf_counter). Each poll is a call the engine core
        answers between steps."""
        while True:
            states = await self._rpc(method)
            if failed := told(states):
                raise WeightSyncError(failed)
            if None not in states:
                return
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{method}: not done by its deadline")
            await asyncio.sleep(POLL_S)

    def shutdown(self) -> None:
        self.llm.shutdown()


def told(answers: Sequence[str | None]) -> str:
    """The first failure the workers told in their answers to a call ("" or None: none)."""
    return next(filter(None, answers), "")


def one_version(kept: list[str], version: int) -> str:
    """Why the workers kept their weights (each worker's word from `receive_weights`: "" where it
    loaded `version`), or "". Where some loaded it and others kept theirs (tensor parallelism: a
    transfer failed on one worker only), the engine's shards hold two versions: no label is true
    of them, so the generator stops (and is restarted with the weights sent to it then)."""
    why = told(kept)
    if why and not all(kept):
        loaded = [i for i, k in enumerate(kept) if not k]
        raise RuntimeError(f"workers {loaded} loaded version {version} while the others kept theirs ({why})")
    return why


def token_versions(spans, n: int) -> list[int]:
    """Per-token versions from vLLM's [start, end) weight-version spans."""
    if not spans:
        raise RuntimeError("vLLM reported no weight-version labels for a finished request")
    versions = [0] * n
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions
