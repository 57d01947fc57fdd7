"""Child processes of the local runner and of multi-GPU trainer pods."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """preexec_fn for child processes: SIGTERM when the parent dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
