"""`python -m pipelinerl_operator.volume_stats`: the NATS store's volume, read from inside its pod
(a sidecar from the operator's image, the volume mounted read-only). Each scrape takes the
mount's capacity and available bytes (statvfs, as the kubelet computes its volume stats: blocks
and blocks available to unprivileged users, times the fragment size).

Why not the kubelet's `kubelet_volume_stats_*`: they exist only where the volume's CSI driver
reports them (hostPath and local-path provisioners do not), Kubernetes 1.34.0 and 1.34.1 lost them
for every CSI volume (kubernetes/kubernetes#133847), and an alert on a series that is absent never
fires: the NATS volume would fill unannounced until JetStream refuses every job's writes.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric

PORT = 7777  # the chart's nats.volumeStatsPort


def volume_bytes(path: Path) -> tuple[int, int]:
    """(capacity, available) bytes of the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


class VolumeCollector:
    """Read on every scrape: a volume that fills between two scrapes shows at the next."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        capacity, available = volume_bytes(self.path)
        yield GaugeMetricFamily(
            "pipelinerl_nats_volume_capacity_bytes", "Size of the NATS store's volume", value=capacity
        )
        yield GaugeMetricFamily(
            "pipelinerl_nats_volume_available_bytes",
            "Bytes of the NATS store's volume that its (unprivileged) server may still write",
            value=available,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelinerl_operator.volume_stats", description=__doc__)
    parser.add_argument("--path", type=Path, default=Path("/data"), help="the volume's mount (default /data)")
    parser.add_argument("--port", type=int, default=PORT, help="the /metrics port")
    parser.add_argument("--address", default="0.0.0.0", help="the address to listen on")
    args = parser.parse_args(argv)
    if not args.path.is_dir():
        parser.error(f"--path {args.path}: not a directory (mount the NATS volume there)")
    registry = CollectorRegistry()
    registry.register(VolumeCollector(args.path))
    server, _thread = start_http_server(args.port, args.address, registry=registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"volume stats of {args.path} on {args.address}:{server.server_port}/metrics", flush=True)
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
