"""`python -m pipelinerl_operator`: run the operator.

PIPELINERL_WATCH_NAMESPACES=a,b (`OperatorEnv.WATCH_NAMESPACES`) → watch only those namespaces
(per-team install, Role/RoleBinding only, no cluster-wide scanning); unset → cluster-wide.

PIPELINERL_PEERING=<name> (the chart sets it): several replicas, one reconciling at a time. They
meet in kopf's peering object of that name; each starts with a random priority, the highest one
alive reconciles and the others pause (taking over within a minute of its end), while every
replica serves the admission webhook. Unset: standalone (one replica).
"""

from __future__ import annotations

import os
import random

import kopf

import pipelinerl_operator.handlers  # noqa: F401  (registers the handlers)
from pipelinerl.contracts import OPERATOR_HEALTH_PORT, OperatorEnv


def watch_namespaces() -> list[str]:
    return [ns.strip() for ns in os.environ.get(OperatorEnv.WATCH_NAMESPACES, "").split(",") if ns.strip()]


def main() -> None:
    namespaces = watch_namespaces()
    peering = os.environ.get(OperatorEnv.PEERING) or None
    kopf.configure(verbose=bool(os.environ.get(OperatorEnv.DEBUG)), log_format=kopf.LogFormat.JSON)
    kopf.run(
        standalone=peering is None,
        peering_name=peering,
        priority=random.SystemRandom().randint(1, 2**31 - 1),  # distinct: peers of equal priority all pause
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=os.environ.get(OperatorEnv.LIVENESS, f"http://0.0.0.0:{OPERATOR_HEALTH_PORT}/healthz"),
    )


if __name__ == "__main__":
    main()
