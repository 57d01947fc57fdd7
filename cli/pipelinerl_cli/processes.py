"""Child processes of the local runner and of multi-GPU trainer pods."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Callable


def die_with_parent(parent: int) -> None:
    """In a child process before its program starts (Linux): SIGTERM when `parent`, the process
    that forked it (its pid taken before the fork), dies. The kernel signals only a death after
    the request: a parent that died between the fork and here is seen by its pid, and the child
    ends now instead of running on with no one to stop it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def dying_with_this_process() -> Callable[[], None]:
    """A `preexec_fn`: the child dies with the process that starts it."""
    return functools.partial(die_with_parent, os.getpid())
