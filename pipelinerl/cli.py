"""`pipelinerl` command line: run a job locally, validate a manifest, start one service, emit the CRD."""

from __future__ import annotations

import argparse
import sys

from pipelinerl.spec import SpecError, dump_job, load_job


def _validate(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    print(f"{args.job}: valid {job.kind} {job.name!r} (mode {job.spec.mode}, max lag {job.spec.max_lag})")
    if args.show:
        print(dump_job(job), end="")
    return 0


def _run(args: argparse.Namespace) -> int:
    from pipelinerl.local import run_local

    return run_local(load_job(args.job), run_dir=args.run_dir)


def _service(args: argparse.Namespace) -> int:
    from pipelinerl.services import run_service

    return run_service(args.role, load_job(args.job))


def _crd(args: argparse.Namespace) -> int:
    from pipelinerl.crd import crd_yaml

    print(crd_yaml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelinerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a PipelineRLJob on this machine (embedded NATS, local processes)")
    p.add_argument("job", help="PipelineRLJob manifest (YAML)")
    p.add_argument("--run-dir", default=None, help="where logs, metrics and checkpoints go (default runs/<name>-<time>)")
    p.set_defaults(func=_run)

    p = sub.add_parser("validate", help="validate a manifest and print field-level errors")
    p.add_argument("job")
    p.add_argument("--show", action="store_true", help="print the manifest with defaults filled in")
    p.set_defaults(func=_validate)

    p = sub.add_parser("service", help="run one service (the entrypoint pods use)")
    p.add_argument("role", choices=["generator", "preprocessor", "trainer"])
    p.add_argument("job")
    p.set_defaults(func=_service)

    p = sub.add_parser("crd", help="print the PipelineRLJob CustomResourceDefinition (generated from the spec)")
    p.set_defaults(func=_crd)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
