"""Trainer ranks as processes of their own, for the tests of what happens between them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_of_two(code: str, rank: int, port: int, **env: str) -> subprocess.Popen:
    """Rank `rank` of 2 running `code` (Python), with torch's env:// rendezvous at 127.0.0.1:port
    and the trainer's package importable; `env`: more of its environment."""
    environ = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "services/trainer")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ
    )
