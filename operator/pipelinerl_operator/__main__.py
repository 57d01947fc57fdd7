"""`python -m pipelinerl_operator`: run the operator.

PIPELINERL_WATCH_NAMESPACES=a,b (`OperatorEnv.WATCH_NAMESPACES`) → watch only those namespaces
(per-team install, Role/RoleBinding only, no cluster-wide scanning); unset → cluster-wide. One replica, no peering (the chart uses a
Recreate Deployment so two operators never run at once).
"""

from __future__ import annotations

import os

import kopf

import pipelinerl_operator.handlers  # noqa: F401  (registers the handlers)
from pipelinerl.contracts import OPERATOR_HEALTH_PORT, OperatorEnv


def watch_namespaces() -> list[str]:
    return [ns.strip() for ns in os.environ.get(OperatorEnv.WATCH_NAMESPACES, "").split(",") if ns.strip()]


def main() -> None:
    namespaces = watch_namespaces()
    kopf.configure(verbose=bool(os.environ.get(OperatorEnv.DEBUG)), log_format=kopf.LogFormat.JSON)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=os.environ.get(OperatorEnv.LIVENESS, f"http://0.0.0.0:{OPERATOR_HEALTH_PORT}/healthz"),
    )


if __name__ == "__main__":
    main()
