"""`pipelinerl` command line: run a job locally, validate a manifest, plan a cluster, start one service,
list a job's dead letters, emit the CRD."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelinerl.contracts import ROLES
from pipelinerl.planner.calibration import CALIBRATIONS
from pipelinerl.spec import PipelineRLJob, SpecError, dump_job, load_job, parse_job, read_manifest

if TYPE_CHECKING:
    from pipelinerl_operator.config import OperatorConfig


def _checked(
    path: str,
    cfg: OperatorConfig,
    runs_here: bool,
    against: str | None = None,
    namespace: str | None = None,
) -> PipelineRLJob:
    """The job at `path`, checked as the operator's admission webhook checks it (the rendered pods
    against Kubernetes' schema too; `cfg`: the install's settings and job policy, `_install`),
    and its model path as far as it can be from here (SpecError); its warnings printed.
    `validate` and `run` both call it, `run` before it starts anything."""
    from pipelinerl.tiny_model import model_path_problem
    from pipelinerl_cli.cluster_only import cluster_only_given
    from pipelinerl_operator.admission import check, job_warnings

    old = read_manifest(against) if against else None
    manifest = read_manifest(path)
    if namespace and isinstance(manifest, dict) and isinstance(manifest.get("metadata"), dict):
        manifest["metadata"].setdefault("namespace", namespace)  # as `kubectl apply -n` places it
    job = check(manifest, old, source=path, cfg=cfg)
    if old is not None:
        try:
            parse_job(old, str(against))
        except SpecError as err:  # the webhook checks such an update on its own too (admission.check)
            print(
                f"warning: {against} no longer reads, so the fields that cannot change were not compared "
                f"(the API server's CRD rules compare them):\n{err}",
                file=sys.stderr,
            )
    problem, note = model_path_problem(job.spec.model.path, runs_here)
    if problem:
        raise SpecError(f"{path} cannot run:\n  spec.{problem}")
    warnings = job_warnings(job, runs_here) + ([f"spec.{note}"] if note else [])
    if runs_here and (ignored := cluster_only_given(job)):
        warnings.append(f"{', '.join(ignored)}: the operator's, on a cluster; a local run leaves them alone")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return job


def _install(values: str | None) -> OperatorConfig:
    """The settings the webhook of an install with these Helm values checks jobs with: its job
    policy, its own Secrets' names (`auth.existingSecret`, ...), its NATS store, its images; no
    file: the chart's defaults (the safe default policy, the default NATS store)."""
    from pipelinerl_operator.config import from_values

    return from_values(read_manifest(values), values) if values else from_values()


def _validate(args: argparse.Namespace) -> int:
    cfg = _install(args.policy)
    job = _checked(args.job, cfg, runs_here=False, against=args.against, namespace=args.namespace)
    print(f"{args.job}: valid {job.kind} {job.name!r} (mode {job.spec.mode}, max lag {job.spec.max_lag})")
    _print_memory_plan(job)
    if args.show:
        print(dump_job(job), end="")
    return 0


def _print_memory_plan(job: PipelineRLJob) -> None:
    from pipelinerl.generator_memory import job_plan

    memory, _ = job_plan(job.spec)
    if memory is not None:
        print("\n".join(memory.lines()))


def _run(args: argparse.Namespace) -> int:
    from pipelinerl_cli.local import run_local

    # What validate refuses (with the same --policy; none: the chart's defaults) never starts.
    # Its NATS is its own, started with the job's max_payload: not the install's.
    job = _checked(args.job, dataclasses.replace(_install(args.policy), nats_max_payload_mb=0), runs_here=True)
    cores = "split" if args.pin_cores else args.cores
    return run_local(job, run_dir=args.run_dir, cores=cores, restart=args.restart == "on-failure")


def _service(args: argparse.Namespace) -> int:
    """The entrypoint of every pod (and of the local runner's children): one service, or the
    rank processes of a multi-GPU trainer pod or a generator pod of several engines."""
    from pipelinerl.runtime import service_env, setup_logging, stay_up_until_stopped

    if args.role in ("generator", "trainer"):
        from pipelinerl.weight_group import reserve_nccl_environment

        reserve_nccl_environment()  # first: nothing has started a thread yet
    job = load_job(args.job)
    env = service_env(args.role, job)
    if (env.ranks_per_pod or 1) > 1:
        from pipelinerl_cli.pod_ranks import run_pod_ranks

        setup_logging(f"{args.role}-pod")
        argv = [sys.executable, "-m", "pipelinerl_cli", "service", args.role, args.job]
        tp = job.spec.generator.tensor_parallel if args.role == "generator" else 1
        return run_pod_ranks(argv, dict(os.environ), args.role, tp)
    setup_logging(f"{args.role}-{env.rank}")
    if args.role == "generator":
        from pipelinerl_generator.main import main
    elif args.role == "preprocessor":
        from pipelinerl_preprocessor.main import main
    else:
        from pipelinerl_trainer.main import main
    code = main(job, env)
    if code == 0 and not env.exit_when_done:
        stay_up_until_stopped(args.role)
    return code


def _plan(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from pipelinerl.planner.calibration import load_calibration, parse_calibration
    from pipelinerl.planner.recommend import format_plan, plan

    job = load_job(args.job)
    try:
        if args.calibrate_from:
            from pipelinerl_cli.calibrate_from import calibration_from_run

            calib, provenance = calibration_from_run(args.calibrate_from, job, base=args.calibration or args.gpu_type)
            print(provenance, file=sys.stderr)
        else:
            calib = load_calibration(
                args.calibration or args.gpu_type or ("h100-7b" if job.spec.generator.gpus else "cpu-tiny")
            )
        if args.mean_tokens is not None or args.length_sigma is not None:
            lengths = calib.lengths.model_dump() | {"distribution": "lognormal", "values": []}
            if args.mean_tokens is not None:
                lengths["mean_tokens"] = args.mean_tokens
            if args.length_sigma is not None:
                lengths["sigma"] = args.length_sigma
            calib = parse_calibration(calib.model_dump() | {"lengths": lengths}, "command line")
        if args.filtered_fraction is not None:
            calib = parse_calibration(
                calib.model_dump() | {"filtered_fraction": args.filtered_fraction}, "command line"
            )
        result = plan(
            job,
            args.gpus,
            calib,
            max_k=args.max_k,
            max_running=args.max_running,
            baseline_logprob_pass=args.baseline_logprob_pass,
        )
    except ValueError as err:  # a bad calibration, run folder or an impossible split, named in the message
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = (
            dataclasses.asdict(result)
            | {"recommended": dataclasses.asdict(result.recommended)}
            | {"best_split": dataclasses.asdict(result.best_split)}
            | {"best_colocated": dataclasses.asdict(result.best_colocated)}
            | result.speedups()
            | {"ratio_range": {b: result.ratio_range(b) for b in ("best_split", "best_colocated")}}
        )
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result))
        _print_memory_plan(job)
    return 0


def _job_in(args: argparse.Namespace) -> PipelineRLJob:
    """The job of the manifest, in `-n NAMESPACE` where given (its streams are named by it)."""
    job = load_job(args.job)
    if getattr(args, "namespace", None):
        job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": args.namespace})})
    return job


NATS_CONNECT_S = 10.0  # a one-off command's wait for the --nats server


def _on_job_store(args: argparse.Namespace, job: PipelineRLJob, client: str, call: Any) -> Any:
    """`call(js)` on the job's JetStream: at `--nats URL`, logged in as the job's pods are (on the
    chart's NATS every job has its own account: PIPELINERL_NATS_USER and PIPELINERL_NATS_PASSWORD,
    read from the job's credentials Secret, docs/kubernetes.md), failing fast; or on the store of
    the local run in `--run-dir`, its nats-server started here for the call."""
    import asyncio

    import nats.errors

    from pipelinerl.contracts import Env
    from pipelinerl.streams import close, connect

    async def run(url: str) -> Any:
        login = os.environ.get(Env.NATS_USER), os.environ.get(Env.NATS_PASSWORD)
        try:  # nats-py tries a server that is not there for as long as it is let
            nc = await asyncio.wait_for(connect(url, client, *login, reconnect=False), NATS_CONNECT_S)
        except (OSError, TimeoutError, nats.errors.Error) as err:
            raise SpecError(f"--nats {url}: cannot reach NATS within {NATS_CONNECT_S:g} s ({err!r})") from None
        try:
            return await call(nc.jetstream())
        finally:
            await close(nc)

    if args.nats:
        return asyncio.run(run(args.nats))
    from pipelinerl_cli.embedded_nats import EmbeddedNats
    from pipelinerl_cli.local import lock_run_dir, resumed_job_problem

    in_use = lock_run_dir(Path(args.run_dir), "ask its NATS instead: --nats <its url, in services.json>")
    try:
        if problem := resumed_job_problem(Path(args.run_dir), job, f"name its own: {Path(args.run_dir) / 'job.yaml'}"):
            raise SpecError(problem)
        server = EmbeddedNats.of_job(Path(args.run_dir) / "nats", job.spec).start()
        try:
            return asyncio.run(run(server.url))
        finally:
            server.stop()
    finally:
        in_use.close()


def _dead_letters(args: argparse.Namespace) -> int:
    """What the job's services rejected, and why: from a running job's NATS, or a local run's store."""
    from pipelinerl.contracts import DEADLETTER_REASON
    from pipelinerl.streams import stored_messages

    job = _job_in(args)
    if args.run_dir and not (Path(args.run_dir) / "nats").is_dir():
        print(
            f"error: {Path(args.run_dir) / 'nats'} does not exist (--run-dir: the folder of a local run)",
            file=sys.stderr,
        )
        return 2
    stream = job.subjects.stream("DEADLETTER")
    letters = _on_job_store(args, job, "pipelinerl-dead-letters", lambda js: stored_messages(js, stream))
    for x in letters:
        kind = x.subject.rsplit(".", 1)[-1]
        when = str(x.time)[:19].replace("T", " ") if x.time else "?"  # UTC
        print(f"#{x.seq} {when} {kind}: {(x.headers or {}).get(DEADLETTER_REASON, '(no reason)')}")
    print(f"{len(letters)} dead letter(s) for job {job.name!r}", file=sys.stderr)
    return 0


def _recover_store(args: argparse.Namespace) -> int:
    """A lost or replaced NATS store (the trainer says StoreLost) made to go on from the trainer's
    checkpoint: locally from the run folder's newest checkpoint, on a cluster from what the
    trainer's StoreLost message names (`pipelinerl.store.recover_store`)."""
    import json

    from pipelinerl.claims import Claims
    from pipelinerl.store import current_identity, recover_store
    from pipelinerl.streams import last_checkpoint

    job = _job_in(args)
    given = [f"--{o}" for o in ("adopt", "step", "problems", "redraw") if getattr(args, o) is not None]
    if args.run_dir and given:
        raise SpecError(f"{', '.join(given)}: with --nats only (a local run's checkpoint names them)")
    if args.run_dir:
        ckpts = Path(args.run_dir) / "checkpoints"
        latest = ckpts / "latest"
        if not latest.is_file():
            raise SpecError(f"no checkpoint in {ckpts}: nothing to go on from (start the run afresh)")
        tag = latest.read_text().strip()
        state = json.loads((ckpts / tag / "state.json").read_text())
        if not state.get("store"):
            raise SpecError(f"the checkpoint {tag} names no store (taken before stores had identities)")
        chosen = state["store"], state["step"], Claims.at_checkpoint(state)
    elif not given:
        chosen = None  # the checkpoint the trainer told on the new store as it found it lost
    elif args.adopt is None or args.step is None or args.problems is None:
        raise SpecError("--adopt, --step and --problems go together (the trainer's StoreLost message names them)")
    else:
        try:
            chosen = args.adopt, args.step, Claims.of(args.problems, args.redraw or "", "--redraw")
        except ValueError as err:
            raise SpecError(str(err)) from None

    async def recover(js):
        if chosen is None and (told := await last_checkpoint(js, job.subjects)) is None:
            raise SpecError(
                f"no checkpoint told on the job's store at {args.nats}: give --adopt, --step and --problems "
                "(and --redraw) as the trainer's StoreLost message names them"
            )
        adopt, step, claims = chosen or (told.store, told.step, told.claims)
        current = await current_identity(js, job.subjects)
        if current is not None and current.id == adopt:  # never lost: its streams are the checkpoint's
            return adopt, step, claims, current
        return adopt, step, claims, await recover_store(js, job.subjects, job.spec, adopt, step, claims)

    adopt, step, claims, identity = _on_job_store(args, job, "pipelinerl-recover-store", recover)
    if identity.id == adopt:
        print(f"store {adopt} is the checkpoint's own (step {step}): nothing to recover, the trainer goes on in it")
        return 0
    redrawn = sum(b - a for a, b in claims.redraw)
    again = f", the {redrawn} claimed then but not settled by its steps drawn again first" if redrawn else ""
    print(
        f"store {identity.id} goes on from the checkpoint of step {step} (store {adopt}); problem claims from "
        f"{claims.next}{again}; its streams start empty"
    )
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipelinerl-k8s")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _crd(args: argparse.Namespace) -> int:
    from pipelinerl.crd import crd_yaml

    print(crd_yaml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelinerl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a PipelineRLJob on this machine (embedded NATS, local processes)")
    p.add_argument("job", help="PipelineRLJob manifest (YAML)")
    p.add_argument(
        "--run-dir", default=None, help="where logs, metrics and checkpoints go (default runs/<name>-<time>)"
    )
    cores = p.add_mutually_exclusive_group()
    cores.add_argument(
        "--pin-cores",
        action="store_true",
        help="give every generator and trainer rank its own cores (needs one per process): --cores split",
    )
    cores.add_argument(
        "--cores",
        choices=["default", "split", "colocated"],
        default="default",
        help="split: as --pin-cores; colocated: the trainer and the generators may each use every core (sync "
        "mode's phases alternate, each on the whole machine, as the conventional baseline runs); default: "
        "unpinned, the trainer uses the cores, a generator one thread",
    )
    p.add_argument(
        "--policy",
        metavar="FILE",
        help="check the job as validate --policy does (a manifest reading a Secret the platform lists, say); "
        "default: the chart's defaults",
    )
    p.add_argument(
        "--restart",
        choices=["on-failure", "never"],
        default="on-failure",
        help="restart a process that fails, after a backoff, up to runPolicy.backoffLimit times "
        "(as Kubernetes restarts a pod), or stop the run at the first failure",
    )
    p.set_defaults(func=_run)

    p = sub.add_parser("validate", help="validate a manifest and print field-level errors")
    p.add_argument("job")
    p.add_argument("--show", action="store_true", help="print the manifest with defaults filled in")
    p.add_argument(
        "--against",
        metavar="OLD",
        help="the stored job this manifest would update: refuse changes "
        "to fields that cannot change, as the cluster does",
    )
    p.add_argument(
        "--policy",
        metavar="FILE",
        help="the install to check against, as its webhook does: the chart's values file (merged over the "
        "chart's defaults as Helm merges it: its jobPolicy, auth.existingSecret, nats.routesExistingSecret, "
        "the NATS store, the services images) or the jobPolicy block alone; default: the chart's defaults",
    )
    p.add_argument("-n", "--namespace", help="the namespace the job goes to, where its manifest names none")
    p.set_defaults(func=_validate)

    p = sub.add_parser(
        "plan",
        help="predict pipeline vs conventional (k steps per generation phase) throughput, lag and idle time; "
        "recommend a split and max lag",
    )
    p.add_argument("job", help="PipelineRLJob manifest: samples per step, attempts, maxTokens, model")
    p.add_argument("--gpus", type=int, required=True, help="devices to split between generators and trainers")
    source = p.add_mutually_exclusive_group()
    builtins = sorted(f.stem for f in CALIBRATIONS.glob("*.yaml"))
    source.add_argument(
        "--gpu-type",
        choices=builtins,
        help="built-in calibration (default: h100-7b when the job asks for GPUs, else cpu-tiny)",
    )
    source.add_argument("--calibration", metavar="FILE", help="calibration measured on your hardware (YAML/JSON)")
    p.add_argument(
        "--calibrate-from",
        metavar="RUN",
        help="derive the costs from a pilot run: a `pipelinerl run` folder, or the NATS URL of the running "
        "job (its METRICS and BATCHES streams); costs a run cannot show come from --gpu-type/--calibration "
        "(default: the built-in for the job's devices); what came from where is printed",
    )
    p.add_argument(
        "--max-k",
        type=int,
        default=32,
        help="conventional baseline: search k (optimizer steps per generation phase) over powers of two "
        "up to this (default 32)",
    )
    p.add_argument(
        "--max-running",
        type=int,
        help="cap on sequences running per generator engine, in every mode (as the reference "
        "implementation's llm_max_rollouts); default: the calibration's batch",
    )
    p.add_argument(
        "--baseline-logprob-pass",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="conventional baseline: the share of its training cost it adds to recompute the old policy's "
        "log-probs in a forward pass of its own, as verl and TRL (steps_per_generation > 1) do: ~0.33, ~0.25 "
        "with activation recomputation; default 0 (this project's sync mode takes the engines' log-probs)",
    )
    p.add_argument("--mean-tokens", type=float, help="override: lognormal completion lengths with this mean")
    p.add_argument("--length-sigma", type=float, help="override: lognormal sigma (0: all completions alike)")
    p.add_argument(
        "--filtered-fraction",
        type=float,
        help="override: share of groups dropped by zero-variance filtering (generated, never trained)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)

    p = sub.add_parser("service", help="run one service (the entrypoint pods use)")
    p.add_argument("role", choices=ROLES)
    p.add_argument("job")
    p.set_defaults(func=_service)

    p = sub.add_parser("dead-letters", help="list what a job's services rejected (rollouts, micro-batches) and why")
    p.add_argument("job")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="a local run's folder (its NATS store)")
    where.add_argument("--nats", metavar="URL", help="the NATS server of a running job")
    p.add_argument("-n", "--namespace", help="the job's namespace (default: the manifest's)")
    p.set_defaults(func=_dead_letters)

    p = sub.add_parser(
        "recover-store", help="make a lost or replaced NATS store go on from the trainer's checkpoint (StoreLost)"
    )
    p.add_argument("job")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="a local run's folder (its store and checkpoints)")
    where.add_argument("--nats", metavar="URL", help="the NATS server of a job on a cluster (the job suspended)")
    p.add_argument(
        "--adopt",
        metavar="STORE",
        help="with --nats: the lost store's id (the trainer's StoreLost message; left out, with the three below: "
        "read from the checkpoint record the trainer told on the new store)",
    )
    p.add_argument("--step", type=int, help="with --nats: the checkpoint's step")
    p.add_argument("--problems", type=int, help="with --nats: problems claimed at the checkpoint")
    p.add_argument(
        "--redraw", metavar="RANGES", help="with --nats: those under --problems the checkpoint did not settle ('3-5,9')"
    )
    p.add_argument("-n", "--namespace", help="the job's namespace (default: the manifest's)")
    p.set_defaults(func=_recover_store)

    p = sub.add_parser("crd", help="print the PipelineRLJob CustomResourceDefinition (generated from the spec)")
    p.set_defaults(func=_crd)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path given that cannot be used (--run-dir naming a file, no permission)
        print(f"error: {err}", file=sys.stderr)
        return 1
