"""`python -m pipelinerl_operator`: run the operator.

PIPELINERL_WATCH_NAMESPACES=a,b  → watch only those namespaces (per-team install, Role/RoleBinding
only, no cluster-wide scanning); unset → cluster-wide. One replica, no peering (the chart uses a
Recreate Deployment so two operators never run at once).
"""

from __future__ import annotations

import os

import kopf

import pipelinerl_operator.handlers  # noqa: F401  (registers the handlers)


def watch_namespaces() -> list[str]:
    return [ns.strip() for ns in os.environ.get("PIPELINERL_WATCH_NAMESPACES", "").split(",") if ns.strip()]


def main() -> None:
    namespaces = watch_namespaces()
    kopf.configure(verbose=bool(os.environ.get("PIPELINERL_DEBUG")), log_format=kopf.LogFormat.JSON)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=os.environ.get("PIPELINERL_LIVENESS", "http://0.0.0.0:8081/healthz"),
    )


if __name__ == "__main__":
    main()
