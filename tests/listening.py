"""Where this machine's sockets listen, as the kernel lists them (/proc/net/tcp, tcp6)."""

from __future__ import annotations

import ipaddress
from pathlib import Path


def listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at `port` ("0.0.0.0"/"::": every address)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # the kernel writes each 32-bit word in host (little-endian) order
                ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(str(ipaddress.ip_address(ordered)))
    return found
