"""A job's egress within the platform's (pure): each of the author's `spec.network.egress` rules
must fall inside one of the policy's `egress` rules (`egress_problems`, a check every door
calls), and is rendered with that rule's exceptions added (`egress_rules`: the intersection);
name lookups go to the cluster DNS only (`dns_egress`)."""

from __future__ import annotations

import ipaddress
from typing import Any

from pipelinerl import reserved
from pipelinerl_operator.job_policy import EgressRule, JobPolicy


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _ports(rule: dict[str, Any]) -> list[tuple[int, int, str]]:
    """(first, last, protocol) of each port of the rule; none if any is not a number, or a range
    ends below its start (the API server refuses that NetworkPolicy)."""
    out = []
    for p in _list(rule.get("ports")):
        p = _dict(p)
        port, end = p.get("port"), p.get("endPort", p.get("port"))
        if not isinstance(port, int) or not isinstance(end, int) or isinstance(port, bool) or end < port:
            return []
        out.append((port, end, str(p.get("protocol", "TCP"))))
    return out


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Never a destination, whatever the platform lists: "this network", multicast, reserved.
NEVER_V4 = ("0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")
# IPv6 that reaches IPv4 space with the IPv4 address inside it in ways not translated here (a
# local NAT64 prefix's split format, Teredo's obfuscated one): never a job's destination.
NEVER_V6 = ("64:ff9b:1::/48", "2001::/32")
_LOW_32 = ("::ffff:0:0/96", "64:ff9b::/96", "::/96")  # IPv4-mapped, NAT64's well-known prefix, IPv4-compatible


def embedded(v4: ipaddress.IPv4Network) -> list[ipaddress.IPv6Network]:
    """The IPv6 networks a packet to `v4` can also be written as (the low 32 bits of the mapped,
    NAT64 and compatible prefixes; 6to4's 2002:AABB:CCDD::/48)."""
    nets = [
        ipaddress.IPv6Network(
            (int(ipaddress.ip_network(p).network_address) | int(v4.network_address), 96 + v4.prefixlen)
        )
        for p in _LOW_32
    ]
    return nets + [ipaddress.IPv6Network(((0x2002 << 112) | (int(v4.network_address) << 80), 16 + v4.prefixlen))]


def excluded(platform: EgressRule, policy: JobPolicy) -> list[Network]:
    """What a platform rule leaves out: its exceptions, what is never a destination, and on IPv6
    every IPv4 exception of the policy's written as IPv6 (so 64:ff9b::10.0.0.1 is as private as
    10.0.0.1)."""
    outer = ipaddress.ip_network(platform.cidr)
    nets = [ipaddress.ip_network(e) for e in platform.except_]
    if outer.version == 4:
        nets += [ipaddress.IPv4Network(n) for n in NEVER_V4]
    else:
        v4 = [ipaddress.IPv4Network(n) for n in NEVER_V4]
        v4 += [
            n
            for r in policy.egress
            for e in r.except_
            if isinstance(n := ipaddress.ip_network(e), ipaddress.IPv4Network)
        ]
        nets += [ipaddress.IPv6Network(n) for n in NEVER_V6] + [n for v in dict.fromkeys(v4) for n in embedded(v)]
    return [n for n in dict.fromkeys(nets) if n.version == outer.version and n.overlaps(outer)]  # type: ignore[arg-type]


def _allowing(rule: Any, policy: JobPolicy) -> tuple[tuple[str, str] | None, EgressRule | None]:
    """The platform rule an author's egress rule falls inside; or why it is outside the policy
    (the sub-field at fault, the reason)."""
    if not isinstance(rule, dict):
        return ("", "an egress rule is a mapping of to and ports"), None
    for key in rule:
        if key not in ("to", "ports"):
            return (f".{key}", "unknown field (an egress rule has to and ports)"), None
    peers = _list(rule.get("to"))
    ports = _ports(rule)
    if not peers or any(set(_dict(p)) != {"ipBlock"} for p in peers):
        return (".to", reserved.EGRESS_TO_WHY), None
    if not ports:
        return (".ports", reserved.EGRESS_PORTS_WHY), None
    blocks = []
    for peer in peers:
        try:
            blocks.append(ipaddress.ip_network(str(_dict(peer["ipBlock"]).get("cidr")), strict=False))
        except ValueError:
            return (".to", "each ipBlock needs a cidr"), None
    for platform in policy.egress:
        outer = ipaddress.ip_network(platform.cidr)
        out = excluded(platform, policy)
        inside = all(
            b.version == outer.version
            and b.subnet_of(outer)  # type: ignore[arg-type]
            and not any(b.version == e.version and b.subnet_of(e) for e in out)  # type: ignore[arg-type]
            for b in blocks
        )
        if inside and (platform.ports is None or all(any(r.covers(*p) for r in platform.ports) for p in ports)):
            return None, platform
    allowed = "; ".join(
        p.cidr
        + (f" except {', '.join(p.except_)}" if p.except_ else "")
        + (f" on {', '.join(f'{r.port}/{r.protocol}' for r in p.ports)}" if p.ports is not None else "")
        for p in policy.egress
    )
    return ("", f"outside what jobs may reach (jobPolicy.egress: {allowed or 'none'})"), None


def egress_problems(rule: Any, policy: JobPolicy) -> list[tuple[str, str]]:
    problem, _ = _allowing(rule, policy)
    return [problem] if problem else []


def egress_rules(rules: list[dict[str, Any]], policy: JobPolicy) -> list[dict[str, Any]]:
    """The author's rules as rendered: each within the platform rule it falls inside, its
    exceptions added (the intersection). Rules outside the policy are left out (the doors refuse them)."""
    out = []
    for rule in rules:
        _, platform = _allowing(rule, policy)
        if platform is None:
            continue
        to = []
        for peer in rule["to"]:
            block = dict(peer["ipBlock"])
            inner = ipaddress.ip_network(block["cidr"], strict=False)
            excepts = list(block.get("except") or [])
            excepts += [
                str(e)
                for e in excluded(platform, policy)
                if e.version == inner.version and e.subnet_of(inner) and e != inner and str(e) not in excepts  # type: ignore[arg-type]
            ]
            if excepts:
                block["except"] = excepts
            to.append({"ipBlock": block})
        out.append({"to": to, "ports": [dict(p) for p in rule["ports"]]})
    return out


def dns_egress(policy: JobPolicy) -> dict[str, Any]:
    """Name lookups go to the cluster DNS only (a resolver anywhere would be a way out)."""
    peers: list[dict[str, Any]] = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.dns.namespace}},
            "podSelector": {"matchLabels": dict(policy.dns.pod_labels)},
        }
    ]
    peers += [{"ipBlock": {"cidr": c}} for c in policy.dns.cidrs]
    return {"to": peers, "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
